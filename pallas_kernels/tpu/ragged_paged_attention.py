"""Ragged paged attention for TPU (Mosaic TPU Pallas): decode and chunked prefill in one kernel.

Layouts are the ones in pallas_kernels/reference.py (its functions are this kernel's oracle), except that the
pages are padded (the engine stores them so, zeros in the padding: Kernels.kv_page_dims): their last dim to
whole 128-lane tiles (`page_head_dim`), and their KV heads to an even count for 16-bit pages (`page_kv_heads`:
XLA lays out an odd count of 16-bit heads unpacked, and the kernel's custom call would copy the whole pool to
repack it):
  q               [T, num_q_heads, head_dim]   flat query tokens (decode: one per sequence)
  k_pages         [num_blocks, block_size, page_kv_heads, page_head_dim]   (v_pages the same)
  block_tables    [S, W] int32   page ids of each sequence; entries past its last page are never read
  context_lens    [S] int32      tokens in the cache, this step's included; 0 = padding row
  query_start_loc [S + 1] int32  sequence s owns query rows [qsl[s], qsl[s+1]); rows from qsl[S]
                                 on are padding and come out as zeros

How it maps to the TPU (the design of jax's pallas/ops/tpu paged_attention and tpu-inference's
ragged paged attention, written again for Ferry's cache layout):
  * block tables (flattened to 1-D: a 2-D SMEM array pads its rows), context lengths, query starts and the
    per-block sequence ranges are scalar prefetch operands (SMEM), so page ids are known to the scalar core
    before any vector work; `smem_bytes` is what they take, checked at engine start (check_smem);
  * K/V pages stay in HBM (memory_space=pl.ANY) and whole pages [block_size, Hkv, Dp] are copied with
    pltpu.make_async_copy into a double-buffered VMEM scratch, `pages_per_block` a block. The copies run one
    block ahead across the whole grid: while a sequence's last block is used, the next sequence's first (in
    the same query block or the next one) streams in, so the DMA pipeline never drains between sequences
    (the grid is therefore sequential, "arbitrary"; a count in SMEM carries the buffer parity across
    programs). Ragged tails (slots past a context, pages past a sequence's last) are masked with iota
    comparisons, and V rows outside the context are zeroed so garbage (NaN) in them cannot reach the output;
  * the grid is over query blocks. Prefill: `block_q` consecutive query tokens, which may belong to
    several sequences (each is visited in turn; every row's online-softmax state changes only
    while its own sequence is visited, because every key of another sequence is masked for it).
    Decode: one sequence per block;
  * GQA: the query heads of one KV head and the block's tokens are the rows of one matmul
    (q is laid out [Hkv, group, tokens, Dp] in the wrapper), so each K/V block is one MXU
    operand for `group * block_q` rows; all KV heads are handled by one program, so each page
    is copied once per query block;
  * head_dim is padded to Dp = a multiple of 128 lanes: q (zeros) and the output in the wrapper, the pages in
    the cache, so every DMA moves whole lane tiles (Mosaic cannot DMA a 64-lane window of a 128-lane tile);
  * online softmax with float32 running max / sum / accumulator in VMEM scratch; optional
    soft-cap (Gemma 2 style: cap * tanh(s / cap));
  * block sizes and the scoped VMEM limit come from the chip's row of tuned_block_sizes.py;
  * sliding window (sliding_window not None: an int32 scalar, traced or not, 0 = none) is one more scalar
    prefetch operand: each visit's K/V blocks start at the page holding the first key its first row sees
    (common.first_visible_key), not at page 0, and so do the copies that start it (the prefetch from the visit
    before), so pages wholly before the window (whose block-table entries may be garbage) are never copied;
    the scores mask each row's keys before its window. None compiles without it;
  * attention sinks (sinks not None: float32 [Hq], reference.py) are one more VMEM input, [Hkv, group, LANES]:
    each row's running max starts at its head's sink and its running sum at 1 (_start_from_sinks), the sink a
    key already seen that adds no value. None compiles without them.

impl="pallas_tpu" compiles it with Mosaic on a TPU; "pallas_tpu_interpret" runs it anywhere with
the TPU interpreter (pltpu.InterpretParams: DMAs, semaphores and VMEM simulated, uninitialised
memory NaN, out-of-bounds reads raise, optional race detection), which is how CI checks it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_quant import SCALE_ELEMS, is_quantized, page_dim, quantize
from pallas_kernels.tpu.layout import LANES, page_head_dim, page_kv_heads, round_up
from pallas_kernels.tpu.tuned_block_sizes import ChipBlockSizes, block_sizes_for
from pallas_kernels.triton.common import MASK_VALUE, check_sinks, first_visible_key, first_window_page, normalise

NUM_BUFFERS = 2  # K/V VMEM buffers: block b is read from b % 2 while b + 1 streams into the other
# SMEM the scalar-prefetched tables may take: a TPU core has 1 MiB (v4-v6), of which the kernel's tables compiled
# at 768 KiB and not at 1 MiB (64 sequences x 3,072 / 4,096 pages, v6e).
SMEM_BUDGET_BYTES = 768 * 1024


def sublane_multiple(dtype) -> int:
    """Rows a VMEM tile holds for `dtype` (8 for 32-bit, 16 for bf16): block_q is a multiple."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def smem_bytes(num_seqs: int, table_width: int, num_q_blocks: int, num_new_rows: int = 0) -> int:
    """SMEM of the scalar prefetch operands: the flat block table, lengths, query starts, block ranges, the
    new K/V rows' slots, and the sliding window (one word, counted whether a layer has one or not)."""
    return 4 * (num_seqs * table_width + num_seqs + num_seqs + 1 + 2 * num_q_blocks + num_new_rows + 1)


def check_smem(num_seqs: int, table_width: int, num_tokens: int) -> None:
    """Raise a ValueError naming the flags to change when a step's tables would not fit SMEM."""
    need = smem_bytes(num_seqs, table_width, max(num_seqs, num_tokens), num_tokens)
    if need > SMEM_BUDGET_BYTES:
        raise ValueError(
            f"the TPU attention kernel's block tables need {need / 1024:.0f} KiB of SMEM ({num_seqs} sequences x "
            f"{table_width} pages each), over its {SMEM_BUDGET_BYTES // 1024} KiB: lower --max_num_seqs or "
            f"--max_model_len, or raise --block_size (pages per sequence = max_model_len / block_size)")


# ----------------------------------------------------------------------------- kernel


class _BlockCopy:
    """The page copies of one K/V block: logical pages first_page .. of sequence `seq` (those below
    num_pages) from HBM into a VMEM buffer [pages_per_block, bs, Hkv, Dp], all on one DMA semaphore. start()
    and wait() loop over the same pages, so every wait has its start (a wait without one would deadlock)."""

    def __init__(self, hbm_ref, buf_ref, sem, tables_ref, table_width, seq, first_page, num_pages):
        self.hbm_ref, self.buf_ref, self.sem = hbm_ref, buf_ref, sem
        self.tables_ref, self.table_width, self.seq, self.first_page = tables_ref, table_width, seq, first_page
        self.count = jnp.clip(num_pages - first_page, 0, buf_ref.shape[0])

    def _copy(self, j):
        page = self.tables_ref[self.seq * self.table_width + self.first_page + j]
        return pltpu.make_async_copy(self.hbm_ref.at[page], self.buf_ref.at[j], self.sem)

    def start(self):
        lax.fori_loop(0, self.count, lambda j, c: (self._copy(j).start(), c)[1], 0)

    def wait(self):
        lax.fori_loop(0, self.count, lambda j, c: (self._copy(j).wait(), c)[1], 0)


def _write_rows(slots_ref, new_k, new_v, k_out, v_out, sem):
    """HBM-to-HBM copies of each new K/V row [Hkv, Dp] into its slot of the cache, all started, then all waited.
    Slots past the cache are dropped (as the XLA scatter's mode="drop" does)."""
    num_rows = new_k.shape[0]
    num_blocks, block_size = k_out.shape[:2]

    def copies(t):
        slot = slots_ref[t]
        page, offset = lax.div(slot, block_size), lax.rem(slot, block_size)  # slot >= 0 where used
        return (slot >= 0) & (page < num_blocks), [
            pltpu.make_async_copy(new.at[t], out.at[page, offset], sem) for new, out in ((new_k, k_out),
                                                                                         (new_v, v_out))]

    def start(t, carry):
        ok, row_copies = copies(t)
        for c in row_copies:
            pl.when(ok)(c.start)
        return carry

    def wait(t, carry):
        ok, row_copies = copies(t)
        for c in row_copies:
            pl.when(ok)(c.wait)
        return carry

    lax.fori_loop(0, num_rows, start, 0)
    lax.fori_loop(0, num_rows, wait, 0)


@dataclasses.dataclass(frozen=True)
class _Visit:
    """One query block's view of one sequence: its rows, where they sit, and the keys they need."""
    seq: jax.Array
    q_start: jax.Array
    q_end: jax.Array
    pos_offset: jax.Array   # absolute position of a row = row + pos_offset
    kv_len: jax.Array       # keys up to the block's last row of the sequence (causal), within the context
    num_pages: jax.Array
    num_kv_blocks: jax.Array  # K/V blocks from first_page on
    first_page: jax.Array | None  # sliding window: the page holding the first row's first key (None: page 0)


def _dequantized(raw, value_dim: int, dtype):
    """Quantized page rows raw [keys, Dp] (lanes: value_dim values, the float32 scale's 4 bytes, zeros;
    pallas_kernels/kv_quant.py) -> value * scale [keys, Dp] in `dtype`, zeros past the values. The scale's bytes
    put together little-endian as uint32 and bitcast (same-width bitcasts and shifts)."""
    word = jnp.zeros((raw.shape[0], 1), jnp.uint32)
    for byte in range(SCALE_ELEMS):
        b = lax.bitcast_convert_type(raw[:, value_dim + byte:value_dim + byte + 1], jnp.uint8).astype(jnp.uint32)
        word = word | (b << (8 * byte))
    scale = lax.bitcast_convert_type(word, jnp.float32)
    lane = lax.broadcasted_iota(jnp.int32, raw.shape, 1)
    return jnp.where(lane < value_dim, raw.astype(jnp.float32) * scale, 0.0).astype(dtype)


def _start_from_sinks(sinks_ref, m_ref, l_ref, block_q: int):
    """Every row's online softmax started from its query head's attention sink: running max = the sink, running
    sum = exp(sink - max) = 1, as if the sink were a key already seen that adds no value (a row that then sees
    no key comes out as zeros). Row r of a KV head's rows is query head r // block_q of its group: a select
    per head over row ranges (no vector division)."""
    num_kv_heads, rows, lanes = m_ref.shape
    row = lax.broadcasted_iota(jnp.int32, (rows, lanes), 0)
    for h in range(num_kv_heads):
        m = jnp.zeros((rows, lanes), jnp.float32)
        for g in range(sinks_ref.shape[1]):
            in_head = (row >= g * block_q) & (row < (g + 1) * block_q)
            m = jnp.where(in_head, sinks_ref[h, g:g + 1, :], m)
        m_ref[h] = m
    l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)


def _ragged_kernel(*refs, table_width: int, scale: float, soft_cap: float | None, write_kv: bool,
                  windowed: bool, value_dim: int | None = None, has_sinks: bool = False):
    """Refs, in order (the ones marked [write_kv] only when this step's K/V rows are written here, [windowed]
    only under a sliding window):
      scalar prefetch (SMEM):
        tables_ref      [S * W] int32    flat block tables
        lens_ref        [S] int32        context length of each sequence
        qsl_ref         [S + 1] int32    query rows of sequence s: [qsl[s], qsl[s+1])
        block_seqs_ref  [num_q_blocks * 2] int32  sequences [first, end) with rows in each block
        window_ref      [1] int32        [windowed] the sliding window (0 = none)
        slots_ref       [T] int32        [write_kv] the cache slot of each new K/V row
      inputs:
        q_ref           [Hkv, group, block_q, Dp] this block's queries (VMEM)
        k_hbm, v_hbm    [N, bs, Hkv, Dp] the whole cache, left in HBM (aliased to the outputs under write_kv)
        new_k, new_v    [T, Hkv, Dp] this step's K/V rows, in HBM [write_kv]
        sinks_ref       [Hkv, group, LANES] f32 each query head's attention sink, over the lanes [has_sinks]
      outputs:
        o_ref           [Hkv, group, block_q, Dp]
        k_out, v_out    [N, bs, Hkv, Dp] the cache, the same buffers as k_hbm, v_hbm [write_kv]
      scratch:
        k_buf, v_buf    [NUM_BUFFERS, pages_per_block, bs, Hkv, Dp] VMEM
        sems            DMA semaphores [3 (K, V, the writes), NUM_BUFFERS]
        blocks_done     [1] int32 SMEM: K/V blocks used so far by this grid (the buffer parity)
        m_ref, l_ref    [Hkv, rows, LANES] f32 running max and sum (replicated over lanes)
        acc_ref         [Hkv, rows, Dp] f32 unnormalised output
    value_dim: quantized pages (int8, float8_e4m3fn): each row's values (head_dim), then its scale; K/V are
    dequantized to q's dtype in VMEM (_dequantized). None: float pages.
    """
    refs = list(refs)
    tables_ref, lens_ref, qsl_ref, block_seqs_ref = refs[:4]
    window_ref = refs.pop(4) if windowed else None
    slots_ref = refs.pop(4) if write_kv else None
    q_ref, k_hbm, v_hbm = refs[4:7]
    new_k, new_v = (refs.pop(7), refs.pop(7)) if write_kv else (None, None)
    sinks_ref = refs.pop(7) if has_sinks else None
    o_ref = refs[7]
    if write_kv:  # read the cache through the outputs: the interpreter keeps aliased buffers apart
        k_hbm, v_hbm = refs.pop(8), refs.pop(8)
    k_buf, v_buf, sems, blocks_done, m_ref, l_ref, acc_ref = refs[8:]
    num_kv_heads, group, block_q, dp = q_ref.shape
    _, pages_per_block, block_size, _, _ = k_buf.shape
    keys_per_block = pages_per_block * block_size
    rows = group * block_q
    num_programs = pl.num_programs(0)
    program = pl.program_id(0)
    block_start = program * block_q  # first query row of this block

    def visit(prog, seq) -> _Visit:
        """Query block `prog` visiting sequence `seq` (pure SMEM arithmetic: any program can ask)."""
        q_start, q_end = qsl_ref[seq], qsl_ref[seq + 1]
        ctx_len = lens_ref[seq]
        pos_offset = ctx_len - (q_end - q_start) - q_start
        first_row = prog * block_q
        last_row = jnp.minimum(q_end, first_row + block_q) - 1
        has_rows = last_row >= jnp.maximum(q_start, first_row)
        kv_len = jnp.where(has_rows, jnp.clip(last_row + pos_offset + 1, 0, ctx_len), 0)
        num_pages = jnp.minimum(pl.cdiv(kv_len, block_size), table_width)
        if not windowed:
            return _Visit(seq, q_start, q_end, pos_offset, kv_len, num_pages, pl.cdiv(num_pages, pages_per_block),
                          None)
        # The visit's blocks start at the page holding its first row's first key: earlier pages are never read.
        first_key = first_visible_key(jnp.maximum(q_start, first_row) + pos_offset, window_ref[0])
        first_page = first_window_page(first_key, block_size, num_pages)
        return _Visit(seq, q_start, q_end, pos_offset, kv_len, num_pages,
                      pl.cdiv(num_pages - first_page, pages_per_block), first_page)

    def seq_range(prog):
        return block_seqs_ref[2 * prog], block_seqs_ref[2 * prog + 1]

    def first_key_pos(v: _Visit, kv_block):
        """The position of K/V block kv_block's first key."""
        first = kv_block * keys_per_block
        return first if v.first_page is None else v.first_page * block_size + first

    def copies(v: _Visit, kv_block, slot):
        first = kv_block * pages_per_block
        if v.first_page is not None:
            first = v.first_page + first
        return [_BlockCopy(hbm, buf.at[slot], sems.at[i, slot], tables_ref, table_width, v.seq, first, v.num_pages)
                for i, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def start(block_copies):
        for c in block_copies:
            c.start()

    def wait(block_copies):
        for c in block_copies:
            c.wait()

    @pl.when(program == 0)
    def _():
        blocks_done[0] = 0
        if write_kv:  # every new row lands before any page is read (the first K/V copies start below)
            _write_rows(slots_ref, new_k, new_v, k_hbm, v_hbm, sems.at[2, 0])

    if sinks_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:
        _start_from_sinks(sinks_ref, m_ref, l_ref, block_q)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Row r of a head's matmul is query head r // block_q of the group, token r % block_q.
    token = block_start + lax.broadcasted_iota(jnp.int32, (rows, keys_per_block), 0) % block_q
    key_in_block = lax.broadcasted_iota(jnp.int32, (rows, keys_per_block), 1)
    v_slot = lax.broadcasted_iota(jnp.int32, (keys_per_block, dp), 0)
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def attend_block(v: _Visit, kv_block, slot):
        """Online-softmax update of every KV head's rows with K/V block `kv_block` in `slot`."""
        block_pos = first_key_pos(v, kv_block)
        key_pos = block_pos + key_in_block
        # Rows of this sequence only, causal, within the keys this block needs.
        mask = ((token >= v.q_start) & (token < v.q_end) & (key_pos < v.kv_len)
                & (key_pos <= token + v.pos_offset))
        if windowed:  # and none before the row's window
            mask = mask & (key_pos >= first_visible_key(token + v.pos_offset, window_ref[0]))
        v_ok = block_pos + v_slot < v.kv_len
        for h in range(num_kv_heads):
            q = q_ref[h].reshape(rows, dp)
            k = k_buf[slot, :, :, h, :].reshape(keys_per_block, dp)
            val = v_buf[slot, :, :, h, :].reshape(keys_per_block, dp)
            if value_dim is not None:
                k, val = _dequantized(k, value_dim, q_ref.dtype), _dequantized(val, value_dim, q_ref.dtype)
            val = jnp.where(v_ok, val, jnp.zeros_like(val))  # garbage past the context must not leak
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h][:, :1]
            m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            # `where`, not just exp: a row whose keys are all masked so far has m == MASK_VALUE.
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
            correction = jnp.exp(m_prev - m_next)
            l_next = correction * l_ref[h][:, :1] + p.sum(axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(val.dtype), val, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = correction * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_next, (rows, LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (rows, LANES))

    first_seq, end_seq = seq_range(program)

    def visit_sequence(seq, carry):
        cur = visit(program, seq)
        # The visit before this one in grid order (this block's previous sequence, or the previous block's
        # last) started this visit's first block if it had blocks of its own; else this visit starts it.
        prev_first, prev_end = seq_range(jnp.maximum(program - 1, 0))
        prev_in_block = seq > first_seq
        has_prev = prev_in_block | ((program > 0) & (prev_end > prev_first))
        last_seq = lens_ref.shape[0] - 1  # clamped: a visit that does not exist must not read past the tables
        prev = visit(jnp.where(prev_in_block, program, program - 1),
                     jnp.clip(jnp.where(prev_in_block, seq - 1, prev_end - 1), 0, last_seq))
        started = has_prev & (prev.num_kv_blocks > 0)
        # The visit after this one: this block's next sequence, or the next block's first.
        next_first, next_end = seq_range(jnp.minimum(program + 1, num_programs - 1))
        next_in_block = seq + 1 < end_seq
        has_next = next_in_block | ((program + 1 < num_programs) & (next_end > next_first))
        nxt = visit(jnp.where(next_in_block, program, program + 1),
                    jnp.clip(jnp.where(next_in_block, seq + 1, next_first), 0, last_seq))
        next_blocks = jnp.where(has_next, nxt.num_kv_blocks, 0)

        @pl.when((cur.num_kv_blocks > 0) & jnp.logical_not(started))
        def _():
            start(copies(cur, 0, blocks_done[0] % NUM_BUFFERS))

        def kv_step(kv_block, _):
            done = blocks_done[0]
            slot, other = done % NUM_BUFFERS, (done + 1) % NUM_BUFFERS
            last = kv_block + 1 == cur.num_kv_blocks

            @pl.when(jnp.logical_not(last))
            def _():  # the next block streams in while this one is used
                start(copies(cur, kv_block + 1, other))

            @pl.when(last & (next_blocks > 0))
            def _():  # ... and after the last, the next visit's first
                start(copies(nxt, 0, other))

            wait(copies(cur, kv_block, slot))
            attend_block(cur, kv_block, slot)
            blocks_done[0] = done + 1
            return 0

        lax.fori_loop(0, cur.num_kv_blocks, kv_step, 0)
        return carry

    lax.fori_loop(first_seq, end_seq, visit_sequence, 0)

    for h in range(num_kv_heads):
        out = normalise(acc_ref[h], l_ref[h][:, 0])  # rows that saw no key come out as zeros
        o_ref[h] = out.reshape(group, block_q, dp).astype(o_ref.dtype)


# ----------------------------------------------------------------------------- wrapper


def block_sequences(query_start_loc, num_blocks: int, block_q: int):
    """[num_blocks * 2] int32: the sequences [first, end) owning rows of each query block, flat."""
    qsl = query_start_loc.astype(jnp.int32)
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(qsl[1:], starts, side="right")        # sequences ending at or before
    end = jnp.searchsorted(qsl[:-1], starts + block_q, side="left")  # sequences starting before end
    return jnp.stack([first, jnp.maximum(end, first)], axis=1).astype(jnp.int32).reshape(-1)


MAX_KEYS_PER_BLOCK = 1024  # Mosaic unrolls a block's per-head work: compile time grows with it


def default_pages_per_block(block_size: int, num_kv_heads: int, dp: int, dtype, kv_block_bytes: int,
                            table_width: int) -> int:
    """Pages per K/V block: as many whole pages as `kv_block_bytes` of K holds, at most MAX_KEYS_PER_BLOCK keys
    and the table's width (a longer block than a sequence's pages is masked work), at least one."""
    page_bytes = block_size * num_kv_heads * dp * jnp.dtype(dtype).itemsize
    return max(1, min(kv_block_bytes // page_bytes, MAX_KEYS_PER_BLOCK // block_size, table_width))


def default_block_q(group: int, dtype, target_rows: int = 128) -> int:
    """Query tokens per prefill block: ~target_rows matmul rows, a multiple of the sublane tile."""
    multiple = sublane_multiple(dtype)
    return max(multiple, round_up(max(1, target_rows // group), multiple))


def interpret_params(interpret):
    """pallas_call's `interpret`: False (Mosaic), or the TPU interpreter's parameters."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


def _cost(num_rows, num_q_heads, head_dim, num_seqs, table_width, block_size, num_kv_heads, dp, itemsize,
          num_programs, decode, new_rows):
    """What the kernel moves and computes when every sequence fills its table (decode: exactly what a step
    at full length reads; prefill: an upper bound, each query block reading one full table of pages), with the
    new K/V rows' copies (read and written once each)."""
    page_bytes = block_size * num_kv_heads * dp * itemsize
    tables_read = num_seqs if decode else num_programs
    keys = tables_read * table_width * block_size
    rows_per_table = 1 if decode else max(1, num_rows // max(1, num_programs))
    return pl.CostEstimate(
        flops=4 * keys * rows_per_table * num_q_heads * dp,
        transcendentals=keys * rows_per_table * num_q_heads,
        bytes_accessed=(2 * tables_read * table_width * page_bytes + 2 * num_rows * num_q_heads * dp * itemsize
                        + 2 * 2 * new_rows * num_kv_heads * dp * itemsize))


_STATIC = ["decode", "scale", "soft_cap", "block_q", "pages_per_block", "device_kind", "interpret", "num_kv_heads"]


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_tpu(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc=None, *,
    decode: bool,
    scale: float,
    soft_cap: float | None = None,
    sliding_window=None,
    sinks=None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    device_kind: str | None = None,
    interpret=False,
    num_kv_heads: int | None = None,
):
    """Decode (q [S, Hq, D], one token per sequence; query_start_loc unused) or chunked prefill
    (flat q [T, Hq, D]) over a paged KV cache -> [rows, Hq, D] in q's dtype.

    Pages whose last dim is not page_head_dim(D) are padded here, a copy of the whole cache: callers that own
    the cache store it padded.
    sliding_window: None (no window), or an int32 scalar, traced or not (0 = none): each query sees its last
      `sliding_window` keys, and the pages wholly before them are never copied.
    sinks: None, or float32 [Hq]: attention sinks (reference.py).
    block_q: prefill query tokens per grid step (multiple of 8, 16 for bf16); decode uses 1.
    pages_per_block: pages per K/V DMA block. Both default to the chip's row of tuned_block_sizes.py.
    device_kind: the chip compiled for (jax.Device.device_kind), which picks that row.
    interpret: False (compile with Mosaic: TPU only), True (TPU interpreter, any backend) or a
      pltpu.InterpretParams (e.g. detect_races=True).
    num_kv_heads: the model's, where the pages hold more (page_kv_heads); default the pages' own.
    """
    return _ragged_call(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, None, decode=decode,
                        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks, block_q=block_q,
                        pages_per_block=pages_per_block, device_kind=device_kind, interpret=interpret,
                        num_kv_heads=num_kv_heads)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("k_pages", "v_pages"))
def write_kv_and_attend_tpu(
    q, k, v, k_pages, v_pages, slot_mapping, block_tables, context_lens, query_start_loc=None, *,
    decode: bool, scale: float, soft_cap: float | None = None, sliding_window=None, sinks=None,
    block_q: int | None = None, pages_per_block: int | None = None, device_kind: str | None = None, interpret=False,
    num_kv_heads=None,
):
    """This step's K/V rows k, v [T, Hkv, D] written into their slots (`slot_mapping` [T]) of the padded pages,
    then attention as ragged_paged_attention_tpu, in one kernel: -> (out, k_pages, v_pages), the pages updated
    in place (aliased: no scatter per layer, no copy of the pool). The new rows land before any page is read."""
    num_kv_heads = k.shape[1]
    page_shape = (page_kv_heads(num_kv_heads, k_pages.dtype), page_head_dim(page_dim(k.shape[-1], k_pages.dtype)))
    if k_pages.shape[2:] != page_shape:
        raise ValueError(f"pages of {k_pages.shape[2:]} (heads, dim): the fused K/V write needs them padded to "
                         f"{page_shape} (Kernels.kv_page_dims)")
    if is_quantized(k_pages.dtype):  # the rows quantized here, each with its scale (pallas_kernels/kv_quant.py)
        k, v = quantize(k, k_pages.dtype), quantize(v, v_pages.dtype)
    pad = ((0, 0), (0, page_shape[0] - num_kv_heads), (0, page_shape[1] - k.shape[-1]))
    new_kv = (jnp.pad(k, pad).astype(k_pages.dtype), jnp.pad(v, pad).astype(v_pages.dtype),
              slot_mapping.astype(jnp.int32))
    return _ragged_call(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, new_kv, decode=decode,
                        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks, block_q=block_q,
                        pages_per_block=pages_per_block, device_kind=device_kind, interpret=interpret,
                        num_kv_heads=num_kv_heads)


def _ragged_call(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, new_kv, *, decode, scale,
                 soft_cap, sliding_window, sinks, block_q, pages_per_block, device_kind, interpret, num_kv_heads):
    num_rows, num_q_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    _, block_size, page_heads, cache_dim = k_pages.shape
    num_kv_heads = num_kv_heads or page_heads
    if k_pages.shape != v_pages.shape or cache_dim < head_dim or page_heads < num_kv_heads:
        raise ValueError(f"q {q.shape} / k_pages {k_pages.shape} / v_pages {v_pages.shape} mismatch")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not divisible by {num_kv_heads} KV heads")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {block_tables.shape} do not match context_lens "
                         f"{context_lens.shape}")
    if decode:
        if num_rows != num_seqs:
            raise ValueError(f"decode: q has {num_rows} rows for {num_seqs} sequences")
        query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
        block_q = 1
    elif query_start_loc is None or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"prefill: query_start_loc must be [{num_seqs + 1}], got "
                         f"{None if query_start_loc is None else query_start_loc.shape}")
    quantized = is_quantized(k_pages.dtype)
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ")
    stored_dim = page_dim(head_dim, k_pages.dtype)  # a quantized row's scale after its values
    dp = page_head_dim(stored_dim)
    if cache_dim != dp:  # a cache stored at head_dim (tests, tpu_check): padded lanes of zeros
        if cache_dim != stored_dim:
            raise ValueError(f"pages' last dim {cache_dim} is neither {stored_dim} nor {dp}")
        pad = ((0, 0), (0, 0), (0, 0), (0, dp - cache_dim))
        k_pages, v_pages = jnp.pad(k_pages, pad), jnp.pad(v_pages, pad)
    group = num_q_heads // num_kv_heads
    sizes: ChipBlockSizes = block_sizes_for(device_kind)
    if block_q is None:
        block_q = default_block_q(group, q.dtype, sizes.prefill_rows)
    if not decode and block_q % sublane_multiple(q.dtype):
        raise ValueError(f"block_q={block_q} must be a multiple of {sublane_multiple(q.dtype)} "
                         f"for {jnp.dtype(q.dtype).name}")
    table_width = block_tables.shape[1]
    pages_per_block = pages_per_block or default_pages_per_block(block_size, page_heads, dp, k_pages.dtype,
                                                                 sizes.kv_block_bytes, table_width)
    num_blocks = pl.cdiv(num_rows, block_q)

    # q -> [Hkv, group, tokens, Dp] (prefill) or [S, Hkv, group, 1, Dp] (decode): a head's rows
    # are one 2-D tile, and every block's last two dims are whole or (8k, 128m).
    q_pad = jnp.pad(q, ((0, num_blocks * block_q - num_rows), (0, 0), (0, dp - head_dim)))
    q_pad = q_pad.reshape(-1, num_kv_heads, group, dp)
    if decode:
        q_in = q_pad[:, :, :, None, :]
        q_spec = pl.BlockSpec((None, num_kv_heads, group, 1, dp), lambda i, *_: (i, 0, 0, 0, 0))
    else:
        q_in = q_pad.transpose(1, 2, 0, 3)
        q_spec = pl.BlockSpec((num_kv_heads, group, block_q, dp), lambda i, *_: (0, 0, i, 0))

    rows = group * block_q
    scratch = [
        pltpu.VMEM((NUM_BUFFERS, pages_per_block, block_size, page_heads, dp), k_pages.dtype),
        pltpu.VMEM((NUM_BUFFERS, pages_per_block, block_size, page_heads, dp), v_pages.dtype),
        pltpu.SemaphoreType.DMA((3, NUM_BUFFERS)),
        pltpu.SMEM((1,), jnp.int32),
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, dp), jnp.float32),
    ]
    prefetch = [block_tables.astype(jnp.int32).reshape(-1), context_lens.astype(jnp.int32),
                query_start_loc.astype(jnp.int32), block_sequences(query_start_loc, num_blocks, block_q)]
    windowed = sliding_window is not None
    if windowed:
        prefetch.append(jnp.asarray(sliding_window, jnp.int32).reshape(1))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # Under shard_map (tensor parallel) the output varies over the mesh axes q does.
    out_shape = [jax.ShapeDtypeStruct(q_in.shape, q.dtype,
                                      manual_axis_type=getattr(jax.typeof(q_in), "manual_axis_type", None))]
    in_specs, out_specs, inputs, aliases = [q_spec, hbm, hbm], [q_spec], [q_in, k_pages, v_pages], {}
    if new_kv is not None:
        new_k, new_v, slots = new_kv
        prefetch.append(slots)
        in_specs += [hbm, hbm]
        inputs += [new_k, new_v]
        out_specs += [hbm, hbm]
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype,
                                           manual_axis_type=getattr(jax.typeof(p), "manual_axis_type", None))
                      for p in (k_pages, v_pages)]
        aliases = {len(prefetch) + 1: 1, len(prefetch) + 2: 2}  # k_pages -> k_out, v_pages -> v_out
    sinks = check_sinks(sinks, num_q_heads)
    if sinks is not None:  # each head's sink over the lanes, as the kernel's running max holds it
        in_specs.append(pl.BlockSpec((num_kv_heads, group, LANES), lambda i, *_: (0, 0, 0)))
        inputs.append(jnp.broadcast_to(sinks.reshape(num_kv_heads, group, 1), (num_kv_heads, group, LANES)))
    kernel = functools.partial(_ragged_kernel, table_width=table_width, scale=float(scale),
                               soft_cap=None if soft_cap is None else float(soft_cap), write_kv=new_kv is not None,
                               windowed=windowed, value_dim=head_dim if quantized else None,
                               has_sinks=sinks is not None)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_blocks,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        # Sequential: each program starts the next one's first K/V copies.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=sizes.vmem_limit_bytes),
        cost_estimate=_cost(num_rows, num_q_heads, head_dim, num_seqs, table_width, block_size, page_heads,
                            dp, jnp.dtype(k_pages.dtype).itemsize, num_blocks, decode,
                            0 if new_kv is None else new_kv[2].shape[0]),
        interpret=interpret_params(interpret),
        name=(f"ferry_ragged_paged_g{group}_d{head_dim}_bs{block_size}_q{block_q}{'_kvw' if new_kv else ''}"
              f"{'_sw' if windowed else ''}{'_sinks' if sinks is not None else ''}"),
    )(*prefetch, *inputs)

    out = outs[0]
    if decode:
        out = out[:, :, :, 0, :]
    else:
        out = out.transpose(2, 0, 1, 3)
    out = out.reshape(-1, num_q_heads, dp)[:num_rows, :, :head_dim]
    return out if new_kv is None else (out, outs[1], outs[2])
