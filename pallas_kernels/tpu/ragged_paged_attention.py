"""Ragged paged attention for TPU (Mosaic TPU Pallas): decode and chunked prefill in one kernel.

Layouts are the ones in pallas_kernels/reference.py (its functions are this kernel's oracle):
  q               [T, num_q_heads, head_dim]   flat query tokens (decode: one per sequence)
  k_pages         [num_blocks, block_size, num_kv_heads, head_dim]   (v_pages the same)
  block_tables    [S, W] int32   page ids of each sequence; entries past its last page are never read
  context_lens    [S] int32      tokens in the cache, this step's included; 0 = padding row
  query_start_loc [S + 1] int32  sequence s owns query rows [qsl[s], qsl[s+1]); rows from qsl[S]
                                 on are padding and come out as zeros

How it maps to the TPU (the design of jax's pallas/ops/tpu paged_attention and tpu-inference's
ragged paged attention, written again for Ferry's cache layout):
  * block tables, context lengths, query starts and the per-block sequence ranges are scalar
    prefetch operands (SMEM), so page ids are known to the scalar core before any vector work;
  * K/V pages stay in HBM (memory_space=pl.ANY). For each sequence the kernel walks its pages
    `pages_per_block` at a time: whole pages [block_size, Hkv, D] are copied with
    pltpu.make_async_copy into a double-buffered VMEM scratch, and the next block's copies are
    started before the current block is used, so DMA overlaps compute. Nothing is gathered by
    vector loads: ragged tails (slots past a context, pages past a sequence's last) are masked
    with iota comparisons, and V rows outside the context are zeroed so garbage (NaN) in them
    cannot reach the output;
  * the grid is over query blocks. Prefill: `block_q` consecutive query tokens, which may belong to
    several sequences (each is visited in turn; every row's online-softmax state changes only
    while its own sequence is visited, because every key of another sequence is masked for it).
    Decode: one sequence per block;
  * GQA: the query heads of one KV head and the block's tokens are the rows of one matmul
    (q is laid out [Hkv, group, tokens, Dp] in the wrapper), so each K/V block is one MXU
    operand for `group * block_q` rows; all KV heads are handled by one program, so each page
    is copied once per query block;
  * head_dim is padded to Dp = a multiple of 128 lanes: q and the output in the wrapper, K/V in
    VMEM (the copy fills the first head_dim lanes of a zeroed buffer);
  * online softmax with float32 running max / sum / accumulator in VMEM scratch; optional
    soft-cap (Gemma 2 style: cap * tanh(s / cap)).

impl="pallas_tpu" compiles it with Mosaic on a TPU; "pallas_tpu_interpret" runs it anywhere with
the TPU interpreter (pltpu.InterpretParams: DMAs, semaphores and VMEM simulated, uninitialised
memory NaN, out-of-bounds reads raise, optional race detection), which is how CI checks it.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.triton.common import MASK_VALUE, normalise, paged_cache_dims

LANES = 128  # a TPU vreg is 8 sublanes x 128 lanes
NUM_BUFFERS = 2  # K/V VMEM buffers: block b is read from b % 2 while b + 1 streams into the other


def sublane_multiple(dtype) -> int:
    """Rows a VMEM tile holds for `dtype` (8 for 32-bit, 16 for bf16): block_q is a multiple."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------- kernel


def _page_copies(hbm_ref, buf_ref, sem, tables_ref, seq, first_page, num_pages, *, head_dim):
    """One (cond, async copy) per page slot of a K or V block: logical pages first_page + j of
    sequence `seq` into buf_ref[j] (its first head_dim lanes); pages >= num_pages are skipped.

    Returned as a list so that start() and wait() run on the very same descriptors and conditions
    (a wait without its start would deadlock the DMA semaphore).
    """
    pages_per_block, _, _, dp = buf_ref.shape
    table_width = tables_ref.shape[1]
    copies = []
    for j in range(pages_per_block):
        logical = first_page + j
        page = tables_ref[seq, jnp.minimum(logical, table_width - 1)]
        dst = buf_ref.at[j] if head_dim == dp else buf_ref.at[j, :, :, pl.ds(0, head_dim)]
        copies.append((logical < num_pages, pltpu.make_async_copy(hbm_ref.at[page], dst, sem)))
    return copies


def _start(copies):
    for cond, copy in copies:
        pl.when(cond)(copy.start)


def _wait(copies):
    for cond, copy in copies:
        pl.when(cond)(copy.wait)


def _ragged_kernel(
    # scalar prefetch (SMEM)
    tables_ref,       # [S, W] int32
    lens_ref,         # [S] int32        context length of each sequence
    qsl_ref,          # [S + 1] int32    query rows of sequence s: [qsl[s], qsl[s+1])
    block_seqs_ref,   # [num_q_blocks, 2] int32  sequences [first, end) with rows in each block
    # inputs
    q_ref,            # [Hkv, group, block_q, Dp] this block's queries (VMEM)
    k_hbm,            # [N, bs, Hkv, D] the whole cache, left in HBM
    v_hbm,            # [N, bs, Hkv, D]
    # output
    o_ref,            # [Hkv, group, block_q, Dp]
    # scratch
    k_buf,            # [NUM_BUFFERS, pages_per_block, bs, Hkv, Dp] VMEM
    v_buf,            # [NUM_BUFFERS, pages_per_block, bs, Hkv, Dp]
    sems,             # DMA semaphores [2 (K, V), NUM_BUFFERS]
    m_ref,            # [Hkv, rows, LANES] f32 running max (replicated over lanes)
    l_ref,            # [Hkv, rows, LANES] f32 running sum
    acc_ref,          # [Hkv, rows, Dp] f32 unnormalised output
    *,
    head_dim: int,
    scale: float,
    soft_cap: float | None,
):
    num_kv_heads, group, block_q, dp = q_ref.shape
    _, pages_per_block, block_size, _, _ = k_buf.shape
    keys_per_block = pages_per_block * block_size
    rows = group * block_q
    table_width = tables_ref.shape[1]
    q_block = pl.program_id(0)
    block_start = q_block * block_q  # first query row of this block

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    if head_dim != dp:  # the padding lanes are never copied into: make them zeros once
        k_buf[...] = jnp.zeros(k_buf.shape, k_buf.dtype)
        v_buf[...] = jnp.zeros(v_buf.shape, v_buf.dtype)

    # Row r of a head's matmul is query head r // block_q of the group, token r % block_q.
    token = block_start + lax.broadcasted_iota(jnp.int32, (rows, keys_per_block), 0) % block_q
    key_in_block = lax.broadcasted_iota(jnp.int32, (rows, keys_per_block), 1)
    v_slot = lax.broadcasted_iota(jnp.int32, (keys_per_block, dp), 0)
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def attend_block(seq_state, kv_block, slot):
        """Online-softmax update of every KV head's rows with K/V block `kv_block` in `slot`."""
        q_start, q_end, pos_offset, kv_len = seq_state
        key_pos = kv_block * keys_per_block + key_in_block
        # Rows of this sequence only, causal, within the keys this block needs.
        mask = ((token >= q_start) & (token < q_end) & (key_pos < kv_len)
                & (key_pos <= token + pos_offset))
        v_ok = kv_block * keys_per_block + v_slot < kv_len
        for h in range(num_kv_heads):
            q = q_ref[h].reshape(rows, dp)
            k = k_buf[slot, :, :, h, :].reshape(keys_per_block, dp)
            v = v_buf[slot, :, :, h, :].reshape(keys_per_block, dp)
            v = jnp.where(v_ok, v, jnp.zeros_like(v))  # garbage past the context must not leak
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
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = correction * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_next, (rows, LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (rows, LANES))

    def visit_sequence(seq, carry):
        q_start, q_end = qsl_ref[seq], qsl_ref[seq + 1]
        ctx_len = lens_ref[seq]
        pos_offset = ctx_len - (q_end - q_start) - q_start  # absolute position = row + offset
        # Keys up to this block's last row of the sequence (causal), within the context.
        last_row = jnp.minimum(q_end, block_start + block_q) - 1
        has_rows = last_row >= jnp.maximum(q_start, block_start)
        kv_len = jnp.where(has_rows, jnp.clip(last_row + pos_offset + 1, 0, ctx_len), 0)
        num_pages = jnp.minimum(pl.cdiv(kv_len, block_size), table_width)
        num_kv_blocks = pl.cdiv(num_pages, pages_per_block)

        def copies(kv_block, slot):
            first = kv_block * pages_per_block
            return (_page_copies(k_hbm, k_buf.at[slot], sems.at[0, slot], tables_ref, seq, first,
                                 num_pages, head_dim=head_dim)
                    + _page_copies(v_hbm, v_buf.at[slot], sems.at[1, slot], tables_ref, seq,
                                   first, num_pages, head_dim=head_dim))

        @pl.when(num_kv_blocks > 0)
        def _():
            _start(copies(0, 0))

        def kv_step(kv_block, _):
            slot = kv_block % NUM_BUFFERS

            @pl.when(kv_block + 1 < num_kv_blocks)
            def _():  # the next block streams in while this one is used
                _start(copies(kv_block + 1, (kv_block + 1) % NUM_BUFFERS))

            _wait(copies(kv_block, slot))
            attend_block((q_start, q_end, pos_offset, kv_len), kv_block, slot)
            return 0

        lax.fori_loop(0, num_kv_blocks, kv_step, 0)
        return carry

    lax.fori_loop(block_seqs_ref[q_block, 0], block_seqs_ref[q_block, 1], visit_sequence, 0)

    for h in range(num_kv_heads):
        out = normalise(acc_ref[h], l_ref[h][:, 0])  # rows that saw no key come out as zeros
        o_ref[h] = out.reshape(group, block_q, dp).astype(o_ref.dtype)


# ----------------------------------------------------------------------------- wrapper


def block_sequences(query_start_loc, num_blocks: int, block_q: int):
    """[num_blocks, 2] int32: the sequences [first, end) owning rows of each query block."""
    qsl = query_start_loc.astype(jnp.int32)
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(qsl[1:], starts, side="right")        # sequences ending at or before
    end = jnp.searchsorted(qsl[:-1], starts + block_q, side="left")  # sequences starting before end
    return jnp.stack([first, jnp.maximum(end, first)], axis=1).astype(jnp.int32)


def default_pages_per_block(block_size: int, target_keys: int = 128) -> int:
    """Pages per K/V block: ~target_keys keys, so each head's score tile is 128 lanes wide."""
    return max(1, target_keys // block_size)


def default_block_q(group: int, dtype, target_rows: int = 128) -> int:
    """Query tokens per prefill block: ~target_rows matmul rows, a multiple of the sublane tile."""
    multiple = sublane_multiple(dtype)
    return max(multiple, round_up(max(1, target_rows // group), multiple))


def interpret_params(interpret):
    """pallas_call's `interpret`: False (Mosaic), or the TPU interpreter's parameters."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


@functools.partial(jax.jit, static_argnames=[
    "decode", "scale", "soft_cap", "block_q", "pages_per_block", "interpret"])
def ragged_paged_attention_tpu(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc=None, *,
    decode: bool,
    scale: float,
    soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret=False,
):
    """Decode (q [S, Hq, D], one token per sequence; query_start_loc unused) or chunked prefill
    (flat q [T, Hq, D]) over a paged KV cache -> [rows, Hq, D] in q's dtype.

    block_q: prefill query tokens per grid step (multiple of 8, 16 for bf16); decode uses 1.
    pages_per_block: pages per K/V DMA block (default ~128 keys).
    interpret: False (compile with Mosaic: TPU only), True (TPU interpreter, any backend) or a
      pltpu.InterpretParams (e.g. detect_races=True).
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = paged_cache_dims(q, k_pages, v_pages)
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
    group = num_q_heads // num_kv_heads
    dp = round_up(head_dim, LANES)
    if block_q is None:
        block_q = default_block_q(group, q.dtype)
    if not decode and block_q % sublane_multiple(q.dtype):
        raise ValueError(f"block_q={block_q} must be a multiple of {sublane_multiple(q.dtype)} "
                         f"for {jnp.dtype(q.dtype).name}")
    pages_per_block = pages_per_block or default_pages_per_block(block_size)
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
        pltpu.VMEM((NUM_BUFFERS, pages_per_block, block_size, num_kv_heads, dp), k_pages.dtype),
        pltpu.VMEM((NUM_BUFFERS, pages_per_block, block_size, num_kv_heads, dp), v_pages.dtype),
        pltpu.SemaphoreType.DMA((2, NUM_BUFFERS)),
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, dp), jnp.float32),
    ]
    prefetch = (block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
                query_start_loc.astype(jnp.int32),
                block_sequences(query_start_loc, num_blocks, block_q))
    kernel = functools.partial(_ragged_kernel, head_dim=head_dim, scale=float(scale),
                               soft_cap=None if soft_cap is None else float(soft_cap))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_blocks,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        # Query blocks are independent (each starts its own copies): megacore may split them.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params(interpret),
        name=f"ferry_ragged_paged_g{group}_d{head_dim}_bs{block_size}_q{block_q}",
    )(*prefetch, q_in, k_pages, v_pages)

    if decode:
        out = out[:, :, :, 0, :]
    else:
        out = out.transpose(2, 0, 1, 3)
    return out.reshape(-1, num_q_heads, dp)[:num_rows, :, :head_dim]
