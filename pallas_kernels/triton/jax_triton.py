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
tile, KV head[, split]); a tile is `block_q` consecutive rows of ONE sequence times the query heads that
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

Split-K decode (num_splits > 1; by default when sequences x KV heads are few for the GPU's SMs) takes the third,
_ragged_paged_attention_split_kernel: each split attends to its share of a sequence's keys and writes the
unnormalised partial, which common.combine_splits turns into the output (adding the sinks there). Tiles, warps
and stages per GPU architecture: tuned_block_sizes.py; what they compile to: gpu_compile.py.

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
from pallas_kernels.triton import tuned_block_sizes
from pallas_kernels.triton.common import (
    MASK_VALUE,
    MIN_DOT_DIM,
    check_sinks,
    choose_num_splits,
    combine_splits,
    gpu_compute_capability,
    gpu_core_count,
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
    out_ptr,         # [T, Hq, D]; split-K: [T, Hq, NUM_SPLITS, D] float32, each split's unnormalised accumulator
    m_ptr,           # split-K: [T, Hq, NUM_SPLITS] float32 running max of each split; else None
    l_ptr,           # split-K: [T, Hq, NUM_SPLITS] float32 running sum of each split; else None
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr,
    GROUP_PADDED: tl.constexpr,     # query heads per KV head, padded to a power of two
    BLOCK_Q: tl.constexpr,          # query tokens per tile; BLOCK_Q * GROUP_PADDED >= 16 (dot)
    HEAD_DIM_PADDED: tl.constexpr,
    TILE_KEYS: tl.constexpr,        # keys per loop step (>= 16): whole pages, or part of one
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,         # 0.0 = none
    DOT_PRECISION: tl.constexpr,    # "ieee" for float32 (Triton's default there is tf32)
    DOT_IN_F32: tl.constexpr,       # interpreter only, for 16-bit inputs (see run_interpreted)
    WINDOWED: tl.constexpr,         # a sliding window: the tile table's sixth column
    TILE_COLS: tl.constexpr,        # the tile table's columns: 5, 6 when WINDOWED
    PAGE_DIM: tl.constexpr,         # a page row's elements per KV head: HEAD_DIM, or HEAD_DIM + 4 quantized
    QUANTIZED: tl.constexpr,        # int8 / float8_e4m3fn pages: each row its values, then its float32 scale
    HAS_SINKS: tl.constexpr,        # attention sinks: each row's softmax starts from its head's
    NUM_SPLITS: tl.constexpr,       # split-K: program_id(2) attends to its share of the keys
):
    """One program of the kernels below: a query tile of one KV head (and, split-K, one share of its keys)."""
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
    io_rows = tok.to(tl.int64) * NUM_Q_HEADS + head
    io_mask = row_ok[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + io_rows[:, None] * HEAD_DIM + d[None, :], mask=io_mask, other=0.0)

    # Keys the tile needs: up to its last real row's position (causal), within the context and the table.
    last_pos = pos0 + tl.minimum(BLOCK_Q, row_end - row0) - 1
    kv_len = tl.minimum(tl.minimum(tl.maximum(last_pos + 1, 0), ctx_len), TABLE_WIDTH * BLOCK_SIZE)
    if WINDOWED:  # from the page holding the first row's first key: earlier pages are never read
        key0 = tl.load(tiles_ptr + tile_id * TILE_COLS + 5)
        first_key = tl.minimum(tl.maximum(key0, 0) // BLOCK_SIZE * BLOCK_SIZE, kv_len)
        row_key0 = key0 + tok_in_tile  # the first key each row sees
    else:
        first_key = 0
    end_key = kv_len
    if NUM_SPLITS > 1:  # this split's share: whole loop steps, so only the last step of the keys is partial
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(kv_len - first_key, NUM_SPLITS), TILE_KEYS) * TILE_KEYS
        first_key = first_key + split * per_split
        end_key = tl.minimum(first_key + per_split, kv_len)

    t = tl.arange(0, TILE_KEYS)
    acc = tl.zeros((BLOCK_Q * GROUP_PADDED, HEAD_DIM_PADDED), tl.float32)
    if HAS_SINKS:  # the sink counts as a key already seen that adds no value: m = sink, l = exp(sink - m) = 1
        m = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
        l = tl.full((BLOCK_Q * GROUP_PADDED,), 1.0, tl.float32)
    else:
        m = tl.full((BLOCK_Q * GROUP_PADDED,), _MASKED, tl.float32)
        l = tl.zeros((BLOCK_Q * GROUP_PADDED,), tl.float32)
    for tile_key in range(first_key, end_key, TILE_KEYS):
        key_pos = tile_key + t
        key_ok = key_pos < end_key
        page = tl.load(tables_ptr + seq * TABLE_WIDTH + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
        # 64-bit: a pool of every layer's pages passes 2**31 elements. Its rows are PAGE_DIM apart, and jax_triton
        # declares every array 16-byte aligned: the feature loads below vectorise (16-byte loads, cp.async).
        row_offsets = ((page.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * PAGE_DIM
        kv_offsets = row_offsets[:, None] + d[None, :]
        kv_mask = key_ok[:, None] & col_ok[None, :]
        if QUANTIZED:  # value * scale; masked: zeros. The scale: the float32 after a row's values (4-byte aligned:
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask)  # rows of HEAD_DIM + 4 bytes, HEAD_DIM a multiple of 4)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask)
            k_scale = tl.load((k_ptr + row_offsets + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True),
                              mask=key_ok, other=0.0)[:, None]
            v_scale = tl.load((v_ptr + row_offsets + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True),
                              mask=key_ok, other=0.0)[:, None]
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
    if NUM_SPLITS > 1:  # the partial, for the combine (common.combine_splits)
        split_rows = io_rows * NUM_SPLITS + split
        tl.store(out_ptr + split_rows[:, None] * HEAD_DIM + d[None, :], acc, mask=io_mask)
        tl.store(m_ptr + split_rows, m, mask=row_ok)
        tl.store(l_ptr + split_rows, l, mask=row_ok)
    else:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # rows that saw no key give zeros
        tl.store(out_ptr + io_rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=io_mask)


# The kernels: _attend_tile (inlined) without sinks; with them, one more pointer; split-K decode, whose outputs are
# the splits' partials (the combine adds the sinks). Separate entry points, so that each compiles only what it
# uses. Their constexprs are _attend_tile's.


@triton.jit
def _ragged_paged_attention_kernel(
    tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, out_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr, GROUP_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    TILE_KEYS: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr, WINDOWED: tl.constexpr, TILE_COLS: tl.constexpr, PAGE_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    _attend_tile(tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, None, out_ptr, None, None,
                 NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_WIDTH, GROUP_PADDED, BLOCK_Q, HEAD_DIM_PADDED,
                 TILE_KEYS, SCALE, SOFT_CAP, DOT_PRECISION, DOT_IN_F32, WINDOWED, TILE_COLS, PAGE_DIM, QUANTIZED,
                 False, 1)


@triton.jit
def _ragged_paged_attention_sinks_kernel(
    tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, sinks_ptr, out_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr, GROUP_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    TILE_KEYS: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr, WINDOWED: tl.constexpr, TILE_COLS: tl.constexpr, PAGE_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    _attend_tile(tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, sinks_ptr, out_ptr, None, None,
                 NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_WIDTH, GROUP_PADDED, BLOCK_Q, HEAD_DIM_PADDED,
                 TILE_KEYS, SCALE, SOFT_CAP, DOT_PRECISION, DOT_IN_F32, WINDOWED, TILE_COLS, PAGE_DIM, QUANTIZED,
                 True, 1)


@triton.jit
def _ragged_paged_attention_split_kernel(
    tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, acc_ptr, m_ptr, l_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TABLE_WIDTH: tl.constexpr, GROUP_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    TILE_KEYS: tl.constexpr, SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr, WINDOWED: tl.constexpr, TILE_COLS: tl.constexpr, PAGE_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    _attend_tile(tiles_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, None, acc_ptr, m_ptr, l_ptr,
                 NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_WIDTH, GROUP_PADDED, BLOCK_Q, HEAD_DIM_PADDED,
                 TILE_KEYS, SCALE, SOFT_CAP, DOT_PRECISION, DOT_IN_F32, WINDOWED, TILE_COLS, PAGE_DIM, QUANTIZED,
                 False, NUM_SPLITS)


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
    num_splits: int = 1      # split-K decode: the kernel whose outputs are the splits' partials

    @property
    def grid(self) -> tuple[int, ...]:
        return (self.num_tiles, self.num_kv_heads) + ((self.num_splits,) if self.num_splits > 1 else ())

    @property
    def kernel(self):
        if self.num_splits > 1:
            return _ragged_paged_attention_split_kernel
        return _ragged_paged_attention_sinks_kernel if self.has_sinks else _ragged_paged_attention_kernel

    def pointer_types(self, dtype, kv_dtype) -> dict[str, str]:
        """The kernel's pointer arguments, in order, with Triton's type names."""
        elem, kv_elem = (f"*{_TRITON_DTYPES[jnp.dtype(x).name]}" for x in (dtype, kv_dtype))
        inputs = {"tiles_ptr": "*i32", "q_ptr": elem, "k_ptr": kv_elem, "v_ptr": kv_elem, "tables_ptr": "*i32"}
        if self.num_splits > 1:
            return {**inputs, "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
        return {**inputs, **({"sinks_ptr": "*fp32"} if self.has_sinks else {}), "out_ptr": elem}

    def out_shapes(self, q_shape, dtype) -> list[jax.ShapeDtypeStruct]:
        """The outputs: q's shape and dtype, or split-K's partials (accumulators, running max and sum)."""
        if self.num_splits == 1:
            return [jax.ShapeDtypeStruct(q_shape, dtype)]
        rows = (*q_shape[:2], self.num_splits)
        return [jax.ShapeDtypeStruct((*rows, q_shape[2]), jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
                jax.ShapeDtypeStruct(rows, jnp.float32)]

    def finish(self, outs, dtype, sinks):
        """The attention output from the kernel's outputs: split-K's partials combined."""
        if self.num_splits == 1:
            return outs[0]
        acc, m, l = (jnp.moveaxis(x, 2, 0) for x in outs)  # splits first, as combine_splits takes them
        return combine_splits(acc, m, l, sinks, dtype)


def plan_launch(q_shape, k_shape, dtype, *, num_seqs: int, table_width: int, decode: bool,
                scale: float, soft_cap: float | None, block_q: int | None = None,
                windowed: bool = False, kv_dtype=None, has_sinks: bool = False, num_splits: int | None = 1,
                compute_capability: int | None = None, blocks: tuned_block_sizes.BlockSizes | None = None) -> Launch:
    """The launch for q [T, Hq, D] over pages k [N, bs, Hkv, D] of `num_seqs` sequences whose
    block tables are `table_width` pages wide; `windowed`: under a sliding window; `kv_dtype`: the pages'
    (default: q's), int8 / float8_e4m3fn for quantized pages ([..., D + 4]: pallas_kernels/kv_quant.py);
    `has_sinks`: with attention sinks (the kernel that takes them).

    Tile sizes, warps and stages are `blocks`, by default the architecture's in the tuned table
    (tuned_block_sizes.py) for `compute_capability` (default: the local GPU's, else sm_90). Decode tiles are one row
    (block_q 1), the head group padded to 16 rows for the dot. num_splits (decode only): split-K shares of each
    sequence's keys; None picks enough to fill the GPU's SMs when sequences x KV heads are few
    (common.choose_num_splits).
    """
    num_tokens, num_q_heads, head_dim = q_shape
    block_size, num_kv_heads = k_shape[1], k_shape[2]
    group_padded = next_pow2(num_q_heads // num_kv_heads)
    head_dim_padded = max(MIN_DOT_DIM, next_pow2(head_dim))
    if compute_capability is None:
        compute_capability = gpu_compute_capability()
    blocks = blocks or tuned_block_sizes.lookup(compute_capability, decode=decode, dtype=dtype,
                                                head_dim_padded=head_dim_padded, block_size=block_size)
    if decode:
        block_q = 1
    elif block_q is None:
        block_q = max(1, blocks.rows // group_padded)
    if block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    if is_quantized(kv_dtype) and head_dim % 4:  # the kernel reads each row's scale as one aligned float32
        raise ValueError(f"quantized pages need head_dim a multiple of 4, got {head_dim}")
    if kv_dtype is not None and jnp.dtype(kv_dtype) == jnp.float8_e4m3fn and compute_capability < 89:
        raise ValueError(f"float8_e4m3fn pages need an sm_89 or newer GPU (this is sm_{compute_capability}): "
                         f"use kv_cache_dtype int8")
    group_padded = max(group_padded, MIN_DOT_DIM // block_q)  # rows >= 16 for the dot
    # Decode: one tile a sequence. Prefill: each of the S + 1 segments adds at most one partial tile.
    num_tiles = num_seqs if decode else -(-num_tokens // block_q) + num_seqs + 1
    if not decode:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads, -(-table_width * block_size // blocks.tile_keys),
                                       gpu_core_count())
    constexprs = dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TABLE_WIDTH=table_width, GROUP_PADDED=group_padded, BLOCK_Q=block_q,
        HEAD_DIM_PADDED=head_dim_padded, TILE_KEYS=blocks.tile_keys, SCALE=float(scale),
        SOFT_CAP=0.0 if soft_cap is None else float(soft_cap),
        DOT_PRECISION="ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32", DOT_IN_F32=False,
        WINDOWED=windowed, TILE_COLS=6 if windowed else 5, PAGE_DIM=k_shape[3], QUANTIZED=is_quantized(kv_dtype))
    if num_splits > 1:
        constexprs["NUM_SPLITS"] = num_splits
    return Launch(num_tiles, num_kv_heads, block_q, blocks.num_warps, blocks.num_stages, constexprs,
                  has_sinks and num_splits == 1, num_splits)


def _launch_for(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, decode,
                scale, soft_cap, sliding_window=None, block_q=None, has_sinks=False, num_splits=1,
                compute_capability=None):
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
                         kv_dtype=k_pages.dtype, has_sinks=has_sinks, num_splits=num_splits,
                         compute_capability=compute_capability)
    tiles = tile_table(jnp.asarray(query_start_loc), jnp.asarray(context_lens), q.shape[0],
                       launch.block_q, launch.num_tiles, sliding_window)
    return launch, tiles


# ----------------------------------------------------------------------------- on a GPU (jax_triton)


def paged_attention_jax_triton(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                               *, decode: bool, scale: float, soft_cap: float | None = None,
                               sliding_window=None, sinks=None, block_q: int | None = None,
                               num_splits: int | None = None):
    """Decode (q [S, Hq, D]) or chunked prefill (flat q [T, Hq, D]) through jax_triton.triton_call;
    needs a CUDA GPU and the `jax-triton` package (extra `cuda12`). sliding_window: None, or an
    int32 scalar, traced or not (0 = none); sinks: None, or float32 [Hq] attention sinks (reference.py);
    num_splits: split-K shares for decode (None: by the SM count, plan_launch)."""
    try:  # only here: it does not import without GPU support in jaxlib
        import jax_triton
    except ImportError as e:
        raise RuntimeError(f'attention impl "jax_triton" needs the jax-triton package on a CUDA '
                           f'jaxlib (pip install -e ".[cuda12]"): {e}') from e

    sinks = check_sinks(sinks, q.shape[1])
    launch, tiles = _launch_for(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                                decode=decode, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                                block_q=block_q, has_sinks=sinks is not None, num_splits=num_splits)
    # jax-triton 0.4 calls the output spec `out_type`; 0.3 (the last for Python 3.11) `out_shape`.
    params = inspect.signature(jax_triton.triton_call).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    inputs = [tiles, q, k_pages, v_pages, block_tables.astype(jnp.int32)] + ([sinks] if launch.has_sinks else [])
    outs = jax_triton.triton_call(
        *inputs, kernel=launch.kernel, grid=launch.grid, num_warps=launch.num_warps,
        num_stages=launch.num_stages, name="ferry_ragged_paged_attention",
        **{out_kw: launch.out_shapes(q.shape, q.dtype)}, **launch.constexprs)
    return launch.finish(outs, q.dtype, sinks)


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
                    sliding_window=None, sinks=None, block_q: int | None = None, num_splits: int = 1,
                    compute_capability: int = 90):
    """The kernel in Triton's interpreter on host copies of the arrays; returns a jax array of
    q's dtype. The outputs start NaN, so an element the kernel fails to write shows up. The tile sizes are
    `compute_capability`'s; num_splits > 1: the split-K kernel and the combine."""
    import torch  # the interpreter reads buffers through torch's storage API

    sinks = check_sinks(sinks, q.shape[1])
    launch, tiles = _launch_for(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                                decode=decode, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                                block_q=block_q, has_sinks=sinks is not None, num_splits=num_splits,
                                compute_capability=compute_capability)

    def host(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.bfloat16:  # numpy has no bfloat16: go through float32 (exact)
            return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
        if x.dtype == jnp.float8_e4m3fn:  # nor float8: its bits
            return torch.from_numpy(np.asarray(x).view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.array(x))

    # Outputs are float32 here, rounded to q's dtype by jnp below: the interpreter's own
    # float32 -> bfloat16 cast truncates, where the GPU's rounds to nearest even.
    outs = [torch.full(s.shape, float("nan"), dtype=torch.float32) for s in launch.out_shapes(q.shape, q.dtype)]
    # Triton 3.9's interpreter multiplies bfloat16's raw bits in tl.dot (it stores bf16 as
    # uint16), so here the dots take float32 copies of the same 16-bit values: products of two
    # bf16 numbers are exact in float32, as in the tensor-core dot with float32 accumulation.
    constexprs = {**launch.constexprs, "DOT_IN_F32": jnp.dtype(q.dtype).itemsize < 4}
    inputs = [host(tiles), host(q), host(k_pages), host(v_pages), host(block_tables.astype(jnp.int32))]
    if launch.has_sinks:
        inputs.append(host(sinks))
    with _interpreted() as interpreted:
        interpreted(launch.kernel)[launch.grid](*inputs, *outs, **constexprs)
    outs = [jnp.asarray(o.numpy()) for o in outs]
    return launch.finish(outs, q.dtype, sinks).astype(q.dtype)


# ----------------------------------------------------------------------------- compile only


def compile_for_gpu(q_shape, k_shape, dtype, *, table_width: int, num_seqs: int, decode: bool,
                    compute_capability: int, scale: float = 1.0,
                    soft_cap: float | None = None, windowed: bool = False, kv_dtype=None,
                    has_sinks: bool = False, num_splits: int = 1,
                    blocks: tuned_block_sizes.BlockSizes | None = None) -> dict:
    """Compile the kernel for CUDA `compute_capability` (80, 89, 90, ...) with no GPU present, as
    jax_triton.triton_call would: the architecture's tuned tiles, and every array argument declared 16-byte
    aligned (triton_call's specialization: XLA's buffers are), which is what lets Triton vectorise the loads;
    `windowed`: the sliding-window form (the window's value is in the tile table, not compiled in);
    `kv_dtype`: the pages' (default `dtype`; int8 / float8_e4m3fn: quantized, k_shape [..., D + 4]);
    `has_sinks`: the kernel with attention sinks; num_splits > 1: the split-K decode kernel; `blocks`: tile sizes
    other than the table's (scripts/tune_triton_kernels.py).

    Returns Triton's assembly stages by name ("ttir", "ttgir", "llir", "ptx", "cubin"), plus
    "shared": the bytes of shared memory a program needs, and "launch": the Launch.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = plan_launch(q_shape, k_shape, dtype, num_seqs=num_seqs, table_width=table_width,
                         decode=decode, scale=scale, soft_cap=soft_cap, windowed=windowed, kv_dtype=kv_dtype,
                         has_sinks=has_sinks, num_splits=num_splits, compute_capability=compute_capability,
                         blocks=blocks)
    pointers = launch.pointer_types(dtype, kv_dtype or dtype)
    signature = {**pointers, **{name: "constexpr" for name in launch.constexprs}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    source = ASTSource(launch.kernel, signature, constexprs=launch.constexprs, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    return {**compiled.asm, "shared": compiled.metadata.shared, "launch": launch}
