"""Paged attention (decode and chunked prefill) in Triton's own language, called from JAX through
`jax_triton.triton_call`: the GPU kernels that outlive Pallas' Triton backend (deprecated in jax
0.11), for every NVIDIA GPU Triton supports (sm_80 A100, sm_89 L4, sm_90 H100/H200, ...).

Layouts are the ones in pallas_kernels/reference.py (contiguous arrays):
  q               [T, num_q_heads, head_dim]   query rows (decode: one a sequence, T = S)
  k_pages         [num_blocks, block_size, num_kv_heads, head_dim]   (v_pages the same)
  block_tables    [S, W] int32   page ids of each sequence; entries past its last page are never read
  context_lens    [S] int32      tokens in the cache, this step's included; 0 = padding row
  query_start_loc [S + 1] int32  (prefill) sequence s owns rows [qsl[s], qsl[s+1]); rows from
                                 qsl[S] to T are padding and come out as zeros

One kernel serves both: decode is ragged prefill with one query row per sequence. Grid: (query
tile, KV head); a tile is `block_q` consecutive rows of ONE sequence times the query heads that
share the KV head (GQA rows: row r = token r // group_padded, head r % group_padded). The tile
table is prefill_attention.tile_table, the one the Pallas prefill kernel uses (decode: query
starts 0..S, block_q 1). Every K/V load is a masked pointer gather through the block table, so
head_dim 80/96 are padded to the next power of two by the load mask (Triton blocks are powers of
two), and slots past the context or behind unused table entries (NaN included) are never read.
Softmax statistics and accumulation are float32; the output has q's dtype.

Sliding window (sliding_window not None: an int32 scalar, traced or not, 0 = none): the tile table gets
tile_table's sixth column, the first key position the tile's first row sees (row i sees keys from that + i), and
the page loop starts at the page holding it, so pages wholly before the window (whose block-table entries may be
garbage) are never read. Without one (WINDOWED False) the kernel compiles as before.

Attention sinks (sinks not None: float32 [Hq], reference.py) take the second entry point,
_ragged_paged_attention_sinks_kernel, with one more pointer: each row's online softmax starts from its head's
sink. Both entry points inline the same tile function; without sinks the kernel is the one it always was.

Three ways to run the same @triton.jit function:
  * on a GPU, `paged_attention_jax_triton` (jax_triton.triton_call; the dispatch's "jax_triton");
  * anywhere, `run_interpreted` in Triton's interpreter on host arrays (torch CPU tensors: the
    interpreter reads buffers through torch's storage API), which is how the CPU tests check it;
  * `compile_for_gpu` compiles it for a GPU target (e.g. sm_80, sm_90) to PTX and cubin on a host
    without one (the triton wheel ships ptxas); jax_triton's own lowering cannot run without the
    CUDA plugin (it serializes the call through jaxlib's CUDA Triton extension).
"""

import contextlib
import inspect
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels.kv_quant import is_quantized
from pallas_kernels.triton.common import (
    MASK_VALUE,
    MIN_DOT_DIM,
    check_sinks,
    kernel_tuning,
    next_pow2,
    paged_cache_dims,
)
from pallas_kernels.triton.prefill import tile_table

_TRITON_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "i8", "float8_e4m3fn": "fp8e4nv"}
_MASKED = tl.constexpr(MASK_VALUE)  # a Triton kernel reads only constexpr globals


@triton.jit
def _attend_tile(
    tiles_ptr,       # [num_tiles, TILE_COLS] int32: first row, end row, position of first row, context, seq,
                     # (WINDOWED) first key position the first row sees
    q_ptr,           # [T, Hq, D]
    k_ptr,           # [N, bs, Hkv, D]
    v_ptr,           # [N, bs, Hkv, D]
    tables_ptr,      # [S, W] int32
    sinks_ptr,       # [Hq] float32 attention sinks (HAS_SINKS), else None
    out_ptr,         # [T, Hq, D]
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr,
    GROUP_PADDED: tl.constexpr,     # query heads per KV head, padded to a power of two
    BLOCK_Q: tl.constexpr,          # query tokens per tile; BLOCK_Q * GROUP_PADDED >= 16 (dot)
    HEAD_DIM_PADDED: tl.constexpr,
    PAGES_PER_STEP: tl.constexpr,   # pages per loop step: PAGES_PER_STEP * BLOCK_SIZE >= 16 keys
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,         # 0.0 = none
    DOT_PRECISION: tl.constexpr,    # "ieee" for float32 (Triton's default there is tf32)
    DOT_IN_F32: tl.constexpr,       # interpreter only, for 16-bit inputs (see run_interpreted)
    WINDOWED: tl.constexpr,         # a sliding window: the tile table's sixth column
    TILE_COLS: tl.constexpr,        # the tile table's columns: 5, 6 when WINDOWED
    PAGE_DIM: tl.constexpr,         # a page row's elements per KV head: HEAD_DIM, or HEAD_DIM + 4 quantized
    QUANTIZED: tl.constexpr,        # int8 / float8_e4m3fn pages: each row its values, then its float32 scale
    HAS_SINKS: tl.constexpr,        # attention sinks: each row's softmax starts from its head's
):
    """One program of the kernels below: a query tile of one KV head."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = NUM_Q_HEADS // NUM_KV_HEADS
    row0 = tl.load(tiles_ptr + tile_id * TILE_COLS + 0)
    row_end = tl.load(tiles_ptr + tile_id * TILE_COLS + 1)
    pos0 = tl.load(tiles_ptr + tile_id * TILE_COLS + 2)
    ctx_len = tl.load(tiles_ptr + tile_id * TILE_COLS + 3)
    seq = tl.load(tiles_ptr + tile_id * TILE_COLS + 4)

    r = tl.arange(0, BLOCK_Q * GROUP_PADDED)
    tok_in_tile = r // GROUP_PADDED
    g = r % GROUP_PADDED
    tok = row0 + tok_in_tile
    head = kv_head * group + g
    row_ok = (tok < row_end) & (g < group)
    q_pos = pos0 + tok_in_tile            # absolute position of each row's token
    d = tl.arange(0, HEAD_DIM_PADDED)
    col_ok = d < HEAD_DIM
    io_offsets = (tok.to(tl.int64) * NUM_Q_HEADS + head)[:, None] * HEAD_DIM + d[None, :]
    io_mask = row_ok[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + io_offsets, mask=io_mask, other=0.0)

    # Keys the tile needs: up to its last real row's position (causal), within the context.
    last_pos = pos0 + tl.minimum(BLOCK_Q, row_end - row0) - 1
    kv_len = tl.minimum(tl.maximum(last_pos + 1, 0), ctx_len)
    num_pages = tl.minimum(tl.cdiv(kv_len, BLOCK_SIZE), TABLE_WIDTH)
    if WINDOWED:  # from the page holding the first row's first key: earlier pages are never read
        key0 = tl.load(tiles_ptr + tile_id * TILE_COLS + 5)
        start_page = tl.minimum(tl.maximum(key0, 0) // BLOCK_SIZE, num_pages)
        row_key0 = key0 + tok_in_tile  # the first key each row sees
    else:
        start_page = 0

    t = tl.arange(0, PAGES_PER_STEP * BLOCK_SIZE)
    page_in_step = t // BLOCK_SIZE
    slot = t % BLOCK_SIZE
    acc = tl.zeros((BLOCK_Q * GROUP_PADDED, HEAD_DIM_PADDED), tl.float32)
    if HAS_SINKS:  # the sink counts as a key already seen that adds no value: m = sink, l = exp(sink - m) = 1
        m = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
        l = tl.full((BLOCK_Q * GROUP_PADDED,), 1.0, tl.float32)
    else:
        m = tl.full((BLOCK_Q * GROUP_PADDED,), _MASKED, tl.float32)
        l = tl.zeros((BLOCK_Q * GROUP_PADDED,), tl.float32)
    for first_page in range(start_page, num_pages, PAGES_PER_STEP):
        logical_page = first_page + page_in_step
        page_ok = logical_page < num_pages
        page = tl.load(tables_ptr + seq * TABLE_WIDTH + logical_page, mask=page_ok, other=0)
        key_pos = logical_page * BLOCK_SIZE + slot
        key_ok = page_ok & (key_pos < kv_len)
        row_offsets = ((page.to(tl.int64) * BLOCK_SIZE + slot) * NUM_KV_HEADS + kv_head) * PAGE_DIM
        kv_offsets = row_offsets[:, None] + d[None, :]
        kv_mask = key_ok[:, None] & col_ok[None, :]
        if QUANTIZED:  # value * scale; the scale's 4 bytes after the values, little-endian; masked: zeros
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask)
            k_word = tl.zeros((PAGES_PER_STEP * BLOCK_SIZE,), tl.uint32)
            v_word = tl.zeros((PAGES_PER_STEP * BLOCK_SIZE,), tl.uint32)
            for byte in tl.static_range(4):
                kb = tl.load(k_ptr + row_offsets + HEAD_DIM + byte, mask=key_ok)
                vb = tl.load(v_ptr + row_offsets + HEAD_DIM + byte, mask=key_ok)
                k_word = k_word | (kb.to(tl.uint8, bitcast=True).to(tl.uint32) << (8 * byte))
                v_word = v_word | (vb.to(tl.uint8, bitcast=True).to(tl.uint32) << (8 * byte))
            k_scale = k_word.to(tl.float32, bitcast=True)[:, None]
            v_scale = v_word.to(tl.float32, bitcast=True)[:, None]
            k = tl.where(kv_mask, k.to(tl.float32) * k_scale, 0.0).to(q.dtype)
            v = tl.where(kv_mask, v.to(tl.float32) * v_scale, 0.0).to(q.dtype)
        else:
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)  # masked keys are zeros, so
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)  # NaN in unused slots can't leak
        if DOT_IN_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = s * SCALE
        if SOFT_CAP > 0.0:
            # tanh through the sigmoid: tl has no tanh that every backend and the interpreter share.
            s = SOFT_CAP * (2.0 * tl.sigmoid(2.0 * s / SOFT_CAP) - 1.0)
        sees = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            sees = sees & (key_pos[None, :] >= row_key0[:, None])
        s = tl.where(sees, s, _MASKED)
        m_next = tl.maximum(m, tl.max(s, axis=1))
        # `where`, not just exp: a row that has seen no key yet has m == _MASKED.
        p = tl.where(sees, tl.exp(s - m_next[:, None]), 0.0)
        correction = tl.exp(m - m_next)
        l = l * correction + tl.sum(p, axis=1)
        p = p.to(v.dtype)  # rounded to the values' dtype for the tensor-core dot
        if DOT_IN_F32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * correction[:, None] + pv
        m = m_next
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # rows that saw no key give zeros
    tl.store(out_ptr + io_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# The kernels: _attend_tile (inlined) without sinks, and with them, which takes one more pointer; two entry points
# so that a model without sinks compiles the kernel it always did. Their constexprs are _attend_tile's.


@triton.jit
def _ragged_paged_attention_kernel(
    tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, out_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr, GROUP_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    PAGES_PER_STEP: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr, WINDOWED: tl.constexpr, TILE_COLS: tl.constexpr, PAGE_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    _attend_tile(tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, None, out_ptr,
                 NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_WIDTH, GROUP_PADDED, BLOCK_Q, HEAD_DIM_PADDED,
                 PAGES_PER_STEP, SCALE, SOFT_CAP, DOT_PRECISION, DOT_IN_F32, WINDOWED, TILE_COLS, PAGE_DIM, QUANTIZED,
                 False)


@triton.jit
def _ragged_paged_attention_sinks_kernel(
    tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, sinks_ptr, out_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr, GROUP_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    PAGES_PER_STEP: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr, WINDOWED: tl.constexpr, TILE_COLS: tl.constexpr, PAGE_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    _attend_tile(tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, sinks_ptr, out_ptr,
                 NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_WIDTH, GROUP_PADDED, BLOCK_Q, HEAD_DIM_PADDED,
                 PAGES_PER_STEP, SCALE, SOFT_CAP, DOT_PRECISION, DOT_IN_F32, WINDOWED, TILE_COLS, PAGE_DIM, QUANTIZED,
                 True)


# ----------------------------------------------------------------------------- launch plan


@dataclass(frozen=True, slots=True)
class Launch:
    """Everything static about one kernel launch; the same for GPU, interpreter and compile-only."""
    num_tiles: int
    num_kv_heads: int
    block_q: int
    num_warps: int
    num_stages: int
    constexprs: dict = field(hash=False)  # the kernel's tl.constexpr arguments
    has_sinks: bool = False  # the kernel that takes the sinks (a pointer before the output's)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.num_tiles, self.num_kv_heads)

    @property
    def kernel(self):
        return _ragged_paged_attention_sinks_kernel if self.has_sinks else _ragged_paged_attention_kernel


def plan_launch(q_shape, k_shape, dtype, *, num_seqs: int, table_width: int, decode: bool,
                scale: float, soft_cap: float | None, block_q: int | None = None,
                windowed: bool = False, kv_dtype=None, has_sinks: bool = False) -> Launch:
    """The launch for q [T, Hq, D] over pages k [N, bs, Hkv, D] of `num_seqs` sequences whose
    block tables are `table_width` pages wide; `windowed`: under a sliding window; `kv_dtype`: the pages'
    (default: q's), int8 / float8_e4m3fn for quantized pages ([..., D + 4]: pallas_kernels/kv_quant.py);
    `has_sinks`: with attention sinks (the kernel that takes them).

    Decode tiles are one row (block_q 1) with the head group padded to 16 rows for the dot;
    prefill tiles are ~64 query rows (~32 for float32), as in the Pallas prefill kernel.
    """
    num_tokens, num_q_heads, head_dim = q_shape
    block_size, num_kv_heads = k_shape[1], k_shape[2]
    group_padded = next_pow2(num_q_heads // num_kv_heads)
    head_dim_padded = max(MIN_DOT_DIM, next_pow2(head_dim))
    target = 32 if jnp.dtype(dtype).itemsize >= 4 else 64
    if decode:
        block_q = 1
    elif block_q is None:
        block_q = max(1, target // group_padded)
    if block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    group_padded = max(group_padded, MIN_DOT_DIM // block_q)  # rows >= 16 for the dot
    pages_per_step, num_warps, num_stages = kernel_tuning(
        block_size, head_dim_padded, dtype, pages_per_step=None, num_warps=None, num_stages=None,
        target_tokens=target)
    # Decode: one tile a sequence. Prefill: each of the S + 1 segments adds at most one partial tile.
    num_tiles = num_seqs if decode else -(-num_tokens // block_q) + num_seqs + 1
    constexprs = dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TABLE_WIDTH=table_width, GROUP_PADDED=group_padded, BLOCK_Q=block_q,
        HEAD_DIM_PADDED=head_dim_padded, PAGES_PER_STEP=pages_per_step, SCALE=float(scale),
        SOFT_CAP=0.0 if soft_cap is None else float(soft_cap),
        DOT_PRECISION="ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32", DOT_IN_F32=False,
        WINDOWED=windowed, TILE_COLS=6 if windowed else 5, PAGE_DIM=k_shape[3], QUANTIZED=is_quantized(kv_dtype))
    return Launch(num_tiles, num_kv_heads, block_q, num_warps, num_stages, constexprs, has_sinks)


def _launch_for(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, decode,
                scale, soft_cap, sliding_window=None, block_q=None, has_sinks=False):
    """(Launch, tile table [num_tiles, 5 or 6] int32) for these arrays, checked against each other."""
    num_seqs = context_lens.shape[0]
    paged_cache_dims(q, k_pages, v_pages)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {block_tables.shape} does not match context_lens {num_seqs}")
    if decode:
        if q.shape[0] != num_seqs:
            raise ValueError(f"decode q {q.shape} needs one row per sequence ({num_seqs})")
        query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    elif query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc {query_start_loc.shape} does not match context_lens")
    launch = plan_launch(q.shape, k_pages.shape, q.dtype, num_seqs=num_seqs,
                         table_width=block_tables.shape[1], decode=decode, scale=scale,
                         soft_cap=soft_cap, block_q=block_q, windowed=sliding_window is not None,
                         kv_dtype=k_pages.dtype, has_sinks=has_sinks)
    tiles = tile_table(jnp.asarray(query_start_loc), jnp.asarray(context_lens), q.shape[0],
                       launch.block_q, launch.num_tiles, sliding_window)
    return launch, tiles


# ----------------------------------------------------------------------------- on a GPU (jax_triton)


def paged_attention_jax_triton(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                               *, decode: bool, scale: float, soft_cap: float | None = None,
                               sliding_window=None, sinks=None, block_q: int | None = None):
    """Decode (q [S, Hq, D]) or chunked prefill (flat q [T, Hq, D]) through jax_triton.triton_call;
    needs a CUDA GPU and the `jax-triton` package (extra `cuda12`). sliding_window: None, or an
    int32 scalar, traced or not (0 = none); sinks: None, or float32 [Hq] attention sinks (reference.py)."""
    try:  # only here: it does not import without GPU support in jaxlib
        import jax_triton
    except ImportError as e:
        raise RuntimeError(f'attention impl "jax_triton" needs the jax-triton package on a CUDA '
                           f'jaxlib (pip install -e ".[cuda12]"): {e}') from e

    sinks = check_sinks(sinks, q.shape[1])
    launch, tiles = _launch_for(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                                decode=decode, scale=scale, soft_cap=soft_cap,
                                sliding_window=sliding_window, block_q=block_q, has_sinks=sinks is not None)
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    # jax-triton 0.4 calls the output spec `out_type`; 0.3 (the last for Python 3.11) `out_shape`.
    params = inspect.signature(jax_triton.triton_call).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    inputs = [tiles, q, k_pages, v_pages, block_tables.astype(jnp.int32)] + ([] if sinks is None else [sinks])
    return jax_triton.triton_call(
        *inputs, kernel=launch.kernel, grid=launch.grid, num_warps=launch.num_warps,
        num_stages=launch.num_stages, name="ferry_ragged_paged_attention", **{out_kw: out}, **launch.constexprs)


# ----------------------------------------------------------------------------- Triton's interpreter


@contextlib.contextmanager
def _interpreted():
    """Yields a function from a kernel to its interpreter twin, with Triton's own @triton.jit library functions
    (tl.sum, tl.max, tl.cdiv, ...) interpreted too while it runs.

    @triton.jit picks the compiled or the interpreted form once, when triton is imported
    (TRITON_INTERPRET); the tests want both in one process (interpreter runs and sm_80/sm_90
    compiles), so the interpreter form is built here, and calls to compiled-form helpers inside
    it run their interpreted rewrite (the interpreter has already patched triton.language for the
    kernel's run, as it does in TRITON_INTERPRET mode).
    """
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction

    def call_interpreted(helper, *args, **kwargs):
        patched = _patch_lang(helper.fn)  # the helper's own module globals (triton.language.core)
        try:
            return InterpretedFunction(helper.fn).rewrite()(*args, **kwargs)
        finally:
            patched.restore()

    original_call = JITFunction.__call__
    JITFunction.__call__ = call_interpreted
    try:
        yield lambda kernel: InterpretedFunction(kernel.fn)
    finally:
        JITFunction.__call__ = original_call


def run_interpreted(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                    decode: bool, scale: float, soft_cap: float | None = None,
                    sliding_window=None, sinks=None, block_q: int | None = None):
    """The kernel in Triton's interpreter on host copies of the arrays; returns a jax array of
    q's dtype. The output buffer starts NaN, so an element the kernel fails to write shows up."""
    import torch  # the interpreter reads buffers through torch's storage API

    sinks = check_sinks(sinks, q.shape[1])
    launch, tiles = _launch_for(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                                decode=decode, scale=scale, soft_cap=soft_cap,
                                sliding_window=sliding_window, block_q=block_q, has_sinks=sinks is not None)

    def host(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.bfloat16:  # numpy has no bfloat16: go through float32 (exact)
            return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
        if x.dtype == jnp.float8_e4m3fn:  # nor float8: its bits
            return torch.from_numpy(np.asarray(x).view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.array(x))

    # The output is float32 here, rounded to q's dtype by jnp below: the interpreter's own
    # float32 -> bfloat16 cast truncates, where the GPU's rounds to nearest even.
    out = torch.full(q.shape, float("nan"), dtype=torch.float32)
    # Triton 3.9's interpreter multiplies bfloat16's raw bits in tl.dot (it stores bf16 as
    # uint16), so here the dots take float32 copies of the same 16-bit values: products of two
    # bf16 numbers are exact in float32, as in the tensor-core dot with float32 accumulation.
    constexprs = {**launch.constexprs, "DOT_IN_F32": jnp.dtype(q.dtype).itemsize < 4}
    inputs = [host(tiles), host(q), host(k_pages), host(v_pages), host(block_tables.astype(jnp.int32))]
    if sinks is not None:
        inputs.append(host(sinks))
    with _interpreted() as interpreted:
        interpreted(launch.kernel)[launch.grid](*inputs, out, **constexprs)
    return jnp.asarray(out.numpy()).astype(q.dtype)


# ----------------------------------------------------------------------------- compile only


def compile_for_gpu(q_shape, k_shape, dtype, *, table_width: int, num_seqs: int, decode: bool,
                    compute_capability: int, scale: float = 1.0,
                    soft_cap: float | None = None, windowed: bool = False, kv_dtype=None,
                    has_sinks: bool = False) -> dict:
    """Compile the kernel for CUDA `compute_capability` (80, 90, ...) with no GPU present;
    `windowed`: the sliding-window form (the window's value is in the tile table, not compiled in);
    `kv_dtype`: the pages' (default `dtype`; int8 / float8_e4m3fn: quantized, k_shape [..., D + 4]);
    `has_sinks`: the kernel with attention sinks.

    Returns Triton's assembly stages by name ("ttir", "ttgir", "llir", "ptx", "cubin"), plus
    "shared": the bytes of shared memory a program needs.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = plan_launch(q_shape, k_shape, dtype, num_seqs=num_seqs, table_width=table_width,
                         decode=decode, scale=scale, soft_cap=soft_cap, windowed=windowed, kv_dtype=kv_dtype,
                         has_sinks=has_sinks)
    constexprs = launch.constexprs
    elem = "*" + _TRITON_DTYPES[jnp.dtype(dtype).name]
    kv_elem = "*" + _TRITON_DTYPES[jnp.dtype(kv_dtype or dtype).name]
    sinks = {"sinks_ptr": "*fp32"} if has_sinks else {}
    signature = {"tiles_ptr": "*i32", "q_ptr": elem, "k_ptr": kv_elem, "v_ptr": kv_elem,
                 "tables_ptr": "*i32", **sinks, "out_ptr": elem, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(launch.kernel, signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32),
                              options={"num_warps": launch.num_warps,
                                       "num_stages": launch.num_stages})
    return {**compiled.asm, "shared": compiled.metadata.shared}
