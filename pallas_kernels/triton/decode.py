"""Paged decode attention as a Pallas kernel (Triton on GPU; interpret mode anywhere).

Layouts are the ones in pallas_kernels/reference.py:
  q            [S, num_q_heads, head_dim]          one query token per sequence
  k_pages      [num_blocks, block_size, num_kv_heads, head_dim]   (v_pages the same)
  block_tables [S, W] int32     page ids of each sequence; entries past its last page are never read
  context_lens [S] int32        tokens in the cache, this step's included; 0 = padding row (zeros out)

Grid: (sequence, KV head, split). One program owns all query heads that share a KV head
(GQA/MQA), so each K/V page is read once per KV head, and it loops (lax.fori_loop) over only the
pages its sequence uses, `pages_per_step` pages per step. Every load is a masked gather by pointer
(page id from the block table, then token, head and feature offsets), so:
  * head_dim need not be a power of two: features are padded to the next power of two by the
    load mask (Triton blocks must be powers of two) and never stored back;
  * the query-head group is padded to at least 16 rows (Triton's dot needs M >= 16);
  * slots past context_len and unused block-table entries are never read, so garbage there
    (NaN included) cannot leak into the output.
With num_splits > 1 each sequence's pages are divided among splits (FlashDecoding): every split
writes an unnormalised partial (acc, running max, running sum), and a small jnp epilogue
combines them. Softmax statistics and accumulation are float32; the output has q's dtype.

Under a sliding window (sliding_window not None) the wrapper passes each sequence's first visible key
position (common.first_visible_key); the program starts its page loop at the page holding it, so the pages
wholly before the window (whose block-table entries may be garbage) are never read, and the splits divide only
the pages the window covers. The window is a traced int32 scalar (per layer, 0 = none); None compiles without it.

Attention sinks (sinks not None: float32 [Hq], reference.py): one more input; a single split starts each row's
online softmax from its sink (common.sink_start), and with num_splits > 1 the epilogue adds them when it combines
the splits, so every split stays the plain partial it is without sinks. None compiles without them.

The helpers (masked load/store, compiler params, the page loop with its online-softmax step, the
pallas_call) are shared with prefill_attention.py, in triton_common.py.
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
    choose_num_splits,
    combine_splits,
    first_visible_key,
    first_window_page,
    gpu_core_count,
    kernel_tuning,
    load_row_sinks,
    masked_load,
    masked_store,
    next_pow2,
    normalise,
    paged_cache_dims,
)

# ----------------------------------------------------------------------------- kernel


def _decode_kernel(
    # inputs
    q_ref,             # [S, Hq, D]       whole array
    k_ref,             # [N, bs, Hkv, D]  whole array
    v_ref,             # [N, bs, Hkv, D]  whole array
    tables_ref,        # [S, W] int32
    lens_ref,          # [S] int32
    *rest,             # ([S] int32 first visible key, windowed only), ([Hq] f32 sinks, single split with sinks
                       # only), (NaN-filled buffers aliased to the outputs, interpret only), outputs
    num_outputs: int,
    windowed: bool,    # a sliding window: rest[0] holds each sequence's first visible key
    sinks_in_kernel: bool,  # attention sinks start each row's softmax (the next of rest)
    group: int,        # query heads per KV head
    group_padded: int,
    head_dim_padded: int,
    pages_per_step: int,
    num_splits: int,
    scale: float,
    soft_cap: float | None,
    interpret: bool,
):
    out_refs = rest[-num_outputs:]
    first_keys_ref = rest[0] if windowed else None
    sinks_ref = rest[int(windowed)] if sinks_in_kernel else None
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_q_heads, head_dim = q_ref.shape[1], q_ref.shape[2]
    block_size, table_width = k_ref.shape[1], tables_ref.shape[1]
    tile = pages_per_step * block_size

    # Rows are this KV head's query heads, padded to group_padded; columns are features, padded
    # to a power of two. Padded rows/columns are loaded as zeros and never stored.
    g = jnp.arange(group_padded)
    d = jnp.arange(head_dim_padded)
    head = kv_head * group + g
    row_ok = g < group
    col_ok = d < head_dim
    # In interpret mode loads clamp the indices of masked-off lanes into bounds, so its gathers never see an
    # out-of-range index. On GPU the mask alone keeps them from being read, and the feature index must stay
    # unclamped: min(d, head_dim - 1) hides its contiguity from Triton, whose loads then go one element at a time
    # instead of 16 bytes. Stores must NOT clamp (a clamped lane would alias a real element and, in interpret mode,
    # write its old value back over it); their masked-off lanes point past the array or at
    # another head's row, which the mask (GPU) or the write-back of the old value (interpret,
    # where out-of-range scatter updates are dropped) leaves untouched.
    head_c = jnp.minimum(head, num_q_heads - 1)
    d_c = jnp.minimum(d, head_dim - 1) if interpret else d
    q = masked_load(q_ref, (seq, head_c[:, None], d_c[None, :]),
                    row_ok[:, None] & col_ok[None, :], 0)

    ctx_len = lens_ref[seq]
    num_pages = jnp.minimum(pl.cdiv(ctx_len, block_size), table_width)
    if windowed:  # skip the pages wholly before the window: never read (their table entries may be garbage)
        first_key = first_keys_ref[seq]
        window_page = first_window_page(first_key, block_size, num_pages)
        pages_seen = num_pages - window_page
    else:
        pages_seen = num_pages
    # This split's pages: an equal share of the pages the sequence actually uses, rounded up
    # to whole loop steps so only the sequence's last step is partial.
    per_split = pl.cdiv(pl.cdiv(pages_seen, num_splits), pages_per_step) * pages_per_step
    first_page = split * per_split
    if windowed:
        first_page = window_page + first_page
    end_page = jnp.minimum(first_page + per_split, num_pages)
    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_step)

    def key_mask(key_ok, key_pos):
        if windowed:  # the first page may start before the window
            key_ok = key_ok & (key_pos >= first_key)
        # Every query head of the group sees the same keys.
        return jnp.broadcast_to(key_ok[None, :], (group_padded, tile))

    acc, m, l = attend_pages(
        q, k_ref, v_ref, tables_ref, seq, kv_head, first_page=first_page, end_page=end_page,
        kv_len=ctx_len, num_steps=num_steps, pages_per_step=pages_per_step, feature=d_c,
        feature_ok=col_ok, scale=scale, soft_cap=soft_cap, key_mask=key_mask,
        row_sinks=None if sinks_ref is None else load_row_sinks(sinks_ref, head, row_ok))

    out_mask = row_ok[:, None] & col_ok[None, :]
    if num_splits == 1:
        (o_ref,) = out_refs
        masked_store(o_ref, (seq, head[:, None], d[None, :]),
                     normalise(acc, l).astype(o_ref.dtype), out_mask)
    else:
        acc_ref, m_ref, l_ref = out_refs
        masked_store(acc_ref, (split, seq, head[:, None], d[None, :]), acc, out_mask)
        masked_store(m_ref, (split, seq, head), m, row_ok)
        masked_store(l_ref, (split, seq, head), l, row_ok)


# ----------------------------------------------------------------------------- wrapper


@functools.partial(
    jax.jit,
    static_argnames=["scale", "soft_cap", "num_splits", "pages_per_step", "num_warps",
                     "num_stages", "compute_capability", "interpret"])
def paged_decode_attention(
    q, k_pages, v_pages, block_tables, context_lens, *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window=None,
    sinks=None,
    num_splits: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    compute_capability: int | None = None,
    interpret: bool = False,
):
    """Decode attention over a paged KV cache: q [S, Hq, D] -> [S, Hq, D] (q's dtype).

    sliding_window: None (no window), or an int32 scalar, traced or not (0 = none): each query sees its last
      `sliding_window` keys, and the pages wholly before them are never read.
    sinks: None, or float32 [Hq]: attention sinks (reference.py).
    num_splits: FlashDecoding page splits per sequence; None picks 1 in interpret mode and, on
      GPU, enough to fill the machine when S * num_kv_heads is small (see choose_num_splits).
    pages_per_step: pages per loop step (tile = pages_per_step * block_size keys, >= 16).
    compute_capability: the GPU whose tuned tiles, warps and stages fill in those not given (tuned_block_sizes.py;
      default: the local GPU's, sm_90 without one).
    interpret: run the kernel in Pallas interpret mode (any backend). Outputs then start as
      NaN-filled buffers aliased into the kernel, so an element it fails to write shows up.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = paged_cache_dims(q, k_pages, v_pages)
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError("block_tables / context_lens do not match q's batch")

    group = num_q_heads // num_kv_heads
    group_padded = max(MIN_DOT_DIM, next_pow2(group))
    head_dim_padded = max(MIN_DOT_DIM, next_pow2(head_dim))
    table_width = block_tables.shape[1]
    pages_per_step, num_warps, num_stages, _ = kernel_tuning(
        block_size, head_dim_padded, q.dtype, decode=True, pages_per_step=pages_per_step, num_warps=num_warps,
        num_stages=num_stages, compute_capability=compute_capability)
    if num_splits is None:
        num_splits = 1 if interpret else choose_num_splits(
            num_seqs * num_kv_heads, pl.cdiv(table_width, pages_per_step), gpu_core_count())

    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32),   # acc
                     jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads), jnp.float32),  # m
                     jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads), jnp.float32)]  # l
    inputs = [q, k_pages, v_pages, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32)]
    windowed = sliding_window is not None
    if windowed:  # the query sits at position context_len - 1
        inputs.append(first_visible_key(context_lens.astype(jnp.int32) - 1, sliding_window))
    sinks = check_sinks(sinks, num_q_heads)
    sinks_in_kernel = sinks is not None and num_splits == 1  # split partials take them in the epilogue
    if sinks_in_kernel:
        inputs.append(sinks)
    kernel = functools.partial(
        _decode_kernel, num_outputs=len(out_shape), windowed=windowed, sinks_in_kernel=sinks_in_kernel,
        group=group, group_padded=group_padded,
        head_dim_padded=head_dim_padded, pages_per_step=pages_per_step, num_splits=num_splits,
        scale=float(scale), soft_cap=None if soft_cap is None else float(soft_cap), interpret=interpret)
    outs = call_kernel(
        kernel, inputs, out_shape, grid=(num_seqs, num_kv_heads, num_splits), interpret=interpret,
        num_warps=num_warps, num_stages=num_stages,
        name=(f"ferry_paged_decode_g{group}_d{head_dim}_bs{block_size}_k{num_splits}{'_sw' if windowed else ''}"
              f"{'_sinks' if sinks_in_kernel else ''}"))

    if num_splits == 1:
        return outs[0]
    acc, m, l = outs
    return combine_splits(acc, m, l, sinks, q.dtype)
