"""Chunked-prefill paged attention as a Pallas kernel (Triton on GPU; interpret mode anywhere).

Layouts are the ones in pallas_kernels/reference.py:
  q               [T, num_q_heads, head_dim]   flat query tokens of all sequences
  k_pages         [num_blocks, block_size, num_kv_heads, head_dim]   (v_pages the same)
  block_tables    [S, W] int32   page ids of each sequence; entries past its last page are never read
  context_lens    [S] int32      tokens in the cache, this step's chunk included
  query_start_loc [S + 1] int32  sequence s owns query rows [qsl[s], qsl[s+1]); rows from
                                 qsl[S] to T are padding and come out as zeros

Every chunk's K/V are already in the pages (the model writes them before attention), so a
chunk attends to its cached prefix and causally within itself purely through the block table:
query row i of sequence s sits at absolute position context_len - query_len + i and sees keys
at positions <= its own.

Grid: (query tile, KV head). A query tile is `block_q` consecutive tokens of ONE sequence
(sequences are cut into tiles separately, so a tile never straddles two) times every query head
of the KV head (GQA rows = block_q * padded group). The wrapper computes, in jnp, a small table
of tiles: the padding rows form one extra "sequence" with context 0, which the kernel writes as
zeros like any row that sees no key; tiles past the last are empty and write nothing. Each tile
loops only over the pages up to its last row's position. Loads are masked gathers, as in the
decode kernel (the page loop, triton_common.attend_pages, is the decode kernel's), so head_dim
80/96 and garbage in unused slots are fine.

Under a sliding window (sliding_window not None: a traced int32 scalar, 0 = none) the tile table gets a sixth
column, the first key position the tile's first row sees (common.first_visible_key; row i sees keys from that
+ i): the tile's page loop starts at the page holding it, so pages wholly before the window (whose block-table
entries may be garbage) are never read. None compiles without it.

Attention sinks (sinks not None: float32 [Hq], reference.py) are one more input: each row's online softmax starts
from its head's sink (common.sink_start). None compiles without them.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton.common import (
    MIN_DOT_DIM,
    attend_pages,
    call_kernel,
    check_sinks,
    first_visible_key,
    first_window_page,
    kernel_tuning,
    load_row_sinks,
    masked_load,
    masked_store,
    next_pow2,
    normalise,
    paged_cache_dims,
)

# Columns of the per-tile table the wrapper builds (_KEY0 under a sliding window only).
_ROW0, _ROW_END, _POS0, _CTX, _SEQ, _KEY0 = range(6)


def _prefill_kernel(
    # inputs
    tiles_ref,   # [num_tiles, 5 or 6] int32: first row, end row, position of first row, context, seq,
                 # (windowed) first key position the first row sees
    q_ref,       # [T, Hq, D]       whole array
    k_ref,       # [N, bs, Hkv, D]  whole array
    v_ref,       # [N, bs, Hkv, D]  whole array
    tables_ref,  # [S, W] int32
    *rest,       # ([Hq] f32 sinks, has_sinks only), (NaN-filled buffer aliased to the output, interpret only),
                 # output [T, Hq, D]
    group: int,
    group_padded: int,
    block_q: int,
    head_dim_padded: int,
    pages_per_step: int,
    scale: float,
    soft_cap: float | None,
    windowed: bool,
    has_sinks: bool,
    interpret: bool,
):
    o_ref = rest[-1]
    sinks_ref = rest[0] if has_sinks else None
    tile_id, kv_head = pl.program_id(0), pl.program_id(1)
    num_tokens, num_q_heads, head_dim = q_ref.shape
    block_size, table_width = k_ref.shape[1], tables_ref.shape[1]
    rows = block_q * group_padded

    row0 = tiles_ref[tile_id, _ROW0]
    row_end = tiles_ref[tile_id, _ROW_END]
    pos0 = tiles_ref[tile_id, _POS0]
    ctx_len = tiles_ref[tile_id, _CTX]
    seq = tiles_ref[tile_id, _SEQ]

    # Row r of the tile is token row0 + r // group_padded, query head kv_head * group + r % gp.
    r = jnp.arange(rows)
    tok_in_tile, g = r // group_padded, r % group_padded
    tok = row0 + tok_in_tile
    head = kv_head * group + g
    row_ok = (tok < row_end) & (g < group)
    q_pos = pos0 + tok_in_tile
    d = jnp.arange(head_dim_padded)
    col_ok = d < head_dim
    d_c = jnp.minimum(d, head_dim - 1) if interpret else d  # clamped for interpret-mode loads (see decode.py)
    q = masked_load(
        q_ref,
        (jnp.minimum(tok, num_tokens - 1)[:, None], jnp.minimum(head, num_q_heads - 1)[:, None],
         d_c[None, :]),
        row_ok[:, None] & col_ok[None, :], 0)

    # Keys this tile needs: up to its last real row's position (causal), within the context.
    last_pos = pos0 + jnp.minimum(block_q, row_end - row0) - 1
    kv_len = jnp.clip(last_pos + 1, 0, ctx_len)
    num_pages = jnp.minimum(pl.cdiv(kv_len, block_size), table_width)
    first_page = None
    if windowed:  # from the page holding the first row's first key: earlier pages are never read
        key0 = tiles_ref[tile_id, _KEY0]
        first_page = first_window_page(key0, block_size, num_pages)
        num_steps = pl.cdiv(num_pages - first_page, pages_per_step)
        row_key0 = key0 + tok_in_tile  # the first key each row sees
    else:
        num_steps = pl.cdiv(num_pages, pages_per_step)

    def key_mask(key_ok, key_pos):
        # [rows, tile], causal: each row sees the keys up to its own position ...
        mask = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if windowed:  # ... and none before its window
            mask = mask & (key_pos[None, :] >= row_key0[:, None])
        return mask

    acc, _, l = attend_pages(
        q, k_ref, v_ref, tables_ref, seq, kv_head, first_page=first_page, end_page=num_pages,
        kv_len=kv_len, num_steps=num_steps, pages_per_step=pages_per_step, feature=d_c,
        feature_ok=col_ok, scale=scale, soft_cap=soft_cap, key_mask=key_mask,
        row_sinks=None if sinks_ref is None else load_row_sinks(sinks_ref, head, row_ok))
    # Unclamped indices: masked-off lanes point past the array or at rows this program leaves
    # unchanged (see the decode kernel's note on stores).
    masked_store(o_ref, (tok[:, None], head[:, None], d[None, :]),
                 normalise(acc, l).astype(o_ref.dtype), row_ok[:, None] & col_ok[None, :])


def tile_table(query_start_loc, context_lens, num_tokens: int, block_q: int, num_tiles: int,
               sliding_window=None):
    """[num_tiles, 5] int32 rows (first row, end row, position of first row, context, seq), and
    under a sliding window (not None) a sixth column: the first key position the first row sees.

    Segments are the S sequences plus the padding rows [qsl[S], T) as a context-0 segment; each
    is cut into ceil(len / block_q) tiles. Tiles past the last are empty (first row = end = T).
    """
    num_seqs = context_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    seg_start = qsl
    seg_end = jnp.concatenate([qsl[1:], jnp.array([num_tokens], jnp.int32)])
    seg_len = jnp.maximum(seg_end - seg_start, 0)
    seg_ctx = jnp.concatenate([context_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    seg_tiles = pl.cdiv(seg_len, block_q)
    cum = jnp.cumsum(seg_tiles)
    tid = jnp.arange(num_tiles, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cum, tid, side="right"), num_seqs).astype(jnp.int32)
    used = tid < cum[-1]
    local = tid - (cum[seg] - seg_tiles[seg])
    row0 = seg_start[seg] + local * block_q
    pos0 = seg_ctx[seg] - seg_len[seg] + (row0 - seg_start[seg])
    columns = [
        jnp.where(used, row0, num_tokens),
        jnp.where(used, seg_end[seg], num_tokens),
        pos0,
        jnp.where(used, seg_ctx[seg], 0),
        jnp.minimum(seg, num_seqs - 1),  # the padding segment reads no pages (context 0)
    ]
    if sliding_window is not None:
        columns.append(first_visible_key(pos0, sliding_window))
    table = jnp.stack(columns, axis=1)
    return table.astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=["scale", "soft_cap", "block_q", "pages_per_step", "num_warps",
                     "num_stages", "compute_capability", "interpret"])
def paged_prefill_attention(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window=None,
    sinks=None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    compute_capability: int | None = None,
    interpret: bool = False,
):
    """Chunked prefill over a paged KV cache: flat q [T, Hq, D] -> [T, Hq, D] (q's dtype).

    sliding_window: None (no window), or an int32 scalar, traced or not (0 = none): each query sees its last
      `sliding_window` keys, and a tile never reads the pages wholly before its rows' windows.
    sinks: None, or float32 [Hq]: attention sinks (reference.py).
    block_q: query tokens per tile (power of two); a tile has block_q * next_pow2(group) rows,
      by default ~64 (~32 for float32), at least 16 (Triton's dot).
    pages_per_step: pages per loop step (tile = pages_per_step * block_size keys, >= 16).
    compute_capability: the GPU whose tuned tiles, warps and stages fill in those not given (tuned_block_sizes.py;
      default: the local GPU's, sm_90 without one).
    interpret: Pallas interpret mode; the output then starts as a NaN-filled aliased buffer,
      so an element the kernel fails to write shows up.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = paged_cache_dims(q, k_pages, v_pages)
    if block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError("block_tables / query_start_loc do not match context_lens")

    group = num_q_heads // num_kv_heads
    group_padded = next_pow2(group)
    head_dim_padded = max(MIN_DOT_DIM, next_pow2(head_dim))
    pages_per_step, num_warps, num_stages, rows = kernel_tuning(
        block_size, head_dim_padded, q.dtype, decode=False, pages_per_step=pages_per_step, num_warps=num_warps,
        num_stages=num_stages, compute_capability=compute_capability)
    if block_q is None:
        block_q = max(1, rows // group_padded)
    block_q = max(block_q, pl.cdiv(MIN_DOT_DIM, group_padded))  # rows >= 16 for the dot
    if block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")

    # Each of the S + 1 segments adds at most one partial tile.
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs + 1
    tiles = tile_table(query_start_loc, context_lens, num_tokens, block_q, num_tiles, sliding_window)
    windowed = sliding_window is not None

    inputs = [tiles, q, k_pages, v_pages, block_tables.astype(jnp.int32)]
    sinks = check_sinks(sinks, num_q_heads)
    if sinks is not None:
        inputs.append(sinks)
    kernel = functools.partial(
        _prefill_kernel, group=group, group_padded=group_padded, block_q=block_q,
        head_dim_padded=head_dim_padded, pages_per_step=pages_per_step, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap), windowed=windowed, has_sinks=sinks is not None,
        interpret=interpret)
    (out,) = call_kernel(
        kernel, inputs, [jax.ShapeDtypeStruct(q.shape, q.dtype)], grid=(num_tiles, num_kv_heads),
        interpret=interpret, num_warps=num_warps, num_stages=num_stages,
        name=(f"ferry_paged_prefill_g{group}_d{head_dim}_bs{block_size}_q{block_q}{'_sw' if windowed else ''}"
              f"{'_sinks' if sinks is not None else ''}"))
    return out
