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

The helpers at the top (masked load/store, compiler params, the online-softmax step) are shared
with prefill_attention.py and guard the Pallas API differences between jax releases.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax >= 0.4.3x: the Triton backend lives in pallas.triton
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # older releases called it pallas.gpu
    from jax.experimental.pallas import gpu as plgpu

MASK_VALUE = -1e30  # finite, so masked scores never make inf - inf = NaN in the softmax
MIN_DOT_DIM = 16  # Triton's tl.dot needs every operand dimension >= 16


# ----------------------------------------------------------------------------- compat helpers


def triton_compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params; passing them is what selects the Triton backend on GPU.

    jax 0.10.x would otherwise lower a GPU pallas_call through Mosaic GPU. The class is
    `CompilerParams` in current releases and `TritonCompilerParams` in older ones.
    """
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def block_spec(block_shape, index_map):
    """pl.BlockSpec by keyword: the positional order changed between jax releases."""
    return pl.BlockSpec(block_shape=block_shape, index_map=index_map)


def whole_array_spec(shape):
    """The whole array as one block, the same for every program (indexed by hand inside)."""
    zeros = (0,) * len(shape)
    return block_spec(tuple(shape), lambda *_: zeros)


def masked_load(ref, idx, mask, other):
    """ref[idx] where mask, `other` elsewhere; masked-off addresses are never touched on GPU."""
    load = getattr(plgpu, "load", None)
    if load is not None:  # jax >= 0.5: plgpu.load(ref.at[idx], ...)
        return load(ref.at[idx], mask=mask, other=other)
    return pl.load(ref, idx, mask=mask, other=other)


def masked_store(ref, idx, val, mask):
    store = getattr(plgpu, "store", None)
    if store is not None:
        store(ref.at[idx], val, mask=mask)
    else:
        pl.store(ref, idx, val, mask=mask)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_precision(dtype):
    # On Triton the default precision for float32 is TF32 (10-bit mantissa): ask for IEEE fp32.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def matmul(a, b, *, transpose_b: bool, precision):
    """a [M, K] @ b [K, N] (or b [N, K] with transpose_b) with float32 accumulation."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def online_softmax_step(q, k, v, mask, carry, *, scale, soft_cap, precision):
    """One key tile of flash attention.

    q [M, Dp], k/v [T, Dp] (masked-off keys loaded as zeros), mask [M, T] bool,
    carry = (acc [M, Dp] f32, m [M] f32 running max, l [M] f32 running sum).
    """
    acc, m_prev, l_prev = carry
    s = matmul(q, k, transpose_b=True, precision=precision) * scale  # [M, T] f32
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # `where`, not just exp: a row with every key masked so far has m == MASK_VALUE and
    # exp(s - m) would be 1 for its masked keys.
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    correction = jnp.exp(m_prev - m_next)
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    pv = matmul(p.astype(v.dtype), v, transpose_b=False, precision=precision)
    return acc * correction[:, None] + pv, m_next, l_next


def normalise(acc, l):
    """acc / l, with rows that saw no key (l == 0) giving zeros instead of NaN."""
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]


def default_pages_per_step(block_size: int, target_tokens: int = 64) -> int:
    """Pages per loop step: a tile of ~target_tokens keys, and never fewer than 16 (dot)."""
    return max(1, max(target_tokens, MIN_DOT_DIM) // block_size)


def default_num_warps(head_dim_padded: int, tile_keys: int) -> int:
    # Each K/V element of a tile is a gathered pointer held in registers: wide tiles (head_dim
    # 256, or 128-token pages) spill with 4 warps (checked with ptxas for sm_90a), not with 8.
    return 8 if head_dim_padded >= 256 or tile_keys >= 128 else 4


def default_num_stages(dtype) -> int:
    # Two-stage pipelining of the page loads; float32 tiles are twice the size and with two
    # stages the head_dim-256 prefill needs ~208 KiB of shared memory, so use one.
    return 2 if jnp.dtype(dtype).itemsize <= 2 else 1


def gpu_core_count(default: int = 132) -> int:
    """Streaming multiprocessors of the local GPU (H100/H200: 132); `default` without one
    (e.g. when lowering for CUDA on a CPU host)."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return default
    if device.platform != "gpu":
        return default
    return int(getattr(device, "core_count", None) or default)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_pages: int, pages_per_step: int,
                      num_cores: int) -> int:
    """FlashDecoding splits so that (sequence, KV head, split) programs fill the GPU twice over,
    while keeping at least ~4 loop steps per split of the longest possible context."""
    programs = num_seqs * num_kv_heads
    if programs >= 2 * num_cores:
        return 1
    wanted = pl.cdiv(2 * num_cores, programs)
    max_useful = max(1, pl.cdiv(max_pages, pages_per_step) // 4)
    splits = max(1, min(wanted, max_useful, 16))
    return 1 << (splits.bit_length() - 1)  # power of two, rounded down


# ----------------------------------------------------------------------------- kernel


def _decode_kernel(
    # inputs
    q_ref,             # [S, Hq, D]       whole array
    k_ref,             # [N, bs, Hkv, D]  whole array
    v_ref,             # [N, bs, Hkv, D]  whole array
    tables_ref,        # [S, W] int32
    lens_ref,          # [S] int32
    *rest,             # (NaN-filled buffers aliased to the outputs, interpret only), outputs
    num_outputs: int,
    group: int,        # query heads per KV head
    group_padded: int,
    head_dim_padded: int,
    pages_per_step: int,
    num_splits: int,
    scale: float,
    soft_cap: float | None,
):
    out_refs = rest[-num_outputs:]
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
    # Loads clamp the indices of masked-off lanes into bounds: the mask already keeps them from
    # being read on GPU, and in interpret mode the gather then never sees an out-of-range index.
    # Stores must NOT clamp (a clamped lane would alias a real element and, in interpret mode,
    # write its old value back over it); their masked-off lanes point past the array or at
    # another head's row, which the mask (GPU) or the write-back of the old value (interpret,
    # where out-of-range scatter updates are dropped) leaves untouched.
    head_c = jnp.minimum(head, num_q_heads - 1)
    d_c = jnp.minimum(d, head_dim - 1)
    q = masked_load(q_ref, (seq, head_c[:, None], d_c[None, :]),
                    row_ok[:, None] & col_ok[None, :], 0)

    ctx_len = lens_ref[seq]
    num_pages = jnp.minimum(pl.cdiv(ctx_len, block_size), table_width)
    # This split's pages: an equal share of the pages the sequence actually uses, rounded up
    # to whole loop steps so only the sequence's last step is partial.
    per_split = pl.cdiv(pl.cdiv(num_pages, num_splits), pages_per_step) * pages_per_step
    first_page = split * per_split
    end_page = jnp.minimum(first_page + per_split, num_pages)
    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_step)

    t = jnp.arange(tile)
    page_in_step, slot = t // block_size, t % block_size
    precision = dot_precision(q_ref.dtype)

    def body(step, carry):
        logical_page = first_page + step * pages_per_step + page_in_step  # [tile]
        page_ok = logical_page < end_page
        page = masked_load(tables_ref, (seq, jnp.minimum(logical_page, table_width - 1)),
                           page_ok, 0)  # unused entries -> page 0 (never dereferenced unmasked)
        key_ok = page_ok & (logical_page * block_size + slot < ctx_len)  # [tile]
        kv_idx = (page[:, None], slot[:, None], kv_head, d_c[None, :])
        kv_mask = key_ok[:, None] & col_ok[None, :]
        k = masked_load(k_ref, kv_idx, kv_mask, 0)  # [tile, Dp]; masked keys are zeros ...
        v = masked_load(v_ref, kv_idx, kv_mask, 0)  # ... so NaN in unused slots cannot leak
        mask = jnp.broadcast_to(key_ok[None, :], (group_padded, tile))
        return online_softmax_step(q, k, v, mask, carry, scale=scale, soft_cap=soft_cap,
                                   precision=precision)

    carry = (jnp.zeros((group_padded, head_dim_padded), jnp.float32),
             jnp.full((group_padded,), MASK_VALUE, jnp.float32),
             jnp.zeros((group_padded,), jnp.float32))
    acc, m, l = lax.fori_loop(0, num_steps, body, carry)

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
                     "num_stages", "interpret"])
def paged_decode_attention(
    q, k_pages, v_pages, block_tables, context_lens, *,
    scale: float,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
):
    """Decode attention over a paged KV cache: q [S, Hq, D] -> [S, Hq, D] (q's dtype).

    num_splits: FlashDecoding page splits per sequence; None picks 1 in interpret mode and, on
      GPU, enough to fill the machine when S * num_kv_heads is small (see choose_num_splits).
    pages_per_step: pages per loop step (tile = pages_per_step * block_size keys, >= 16).
    interpret: run the kernel in Pallas interpret mode (any backend). Outputs then start as
      NaN-filled buffers aliased into the kernel, so an element it fails to write shows up.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, head_dim_k = k_pages.shape
    if k_pages.shape != v_pages.shape or head_dim_k != head_dim:
        raise ValueError(f"q {q.shape} / k_pages {k_pages.shape} / v_pages {v_pages.shape} mismatch")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not divisible by {num_kv_heads} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError("block_tables / context_lens do not match q's batch")

    group = num_q_heads // num_kv_heads
    group_padded = max(MIN_DOT_DIM, next_pow2(group))
    head_dim_padded = max(MIN_DOT_DIM, next_pow2(head_dim))
    table_width = block_tables.shape[1]
    if pages_per_step is None:
        pages_per_step = default_pages_per_step(block_size)
    if pages_per_step * block_size < MIN_DOT_DIM or pages_per_step & (pages_per_step - 1):
        raise ValueError(f"pages_per_step={pages_per_step} must be a power of two giving >= 16 keys")
    if num_splits is None:
        num_splits = 1 if interpret else choose_num_splits(
            num_seqs, num_kv_heads, table_width, pages_per_step, gpu_core_count())
    if num_warps is None:
        num_warps = default_num_warps(head_dim_padded, pages_per_step * block_size)
    if num_stages is None:
        num_stages = default_num_stages(q.dtype)

    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32),   # acc
                     jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads), jnp.float32),  # m
                     jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads), jnp.float32)]  # l
    inputs = [q, k_pages, v_pages, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32)]
    aliases = {}
    if interpret:  # poison: every output element the kernel does not write stays NaN
        for i, s in enumerate(out_shape):
            aliases[len(inputs)] = i
            inputs.append(jnp.full(s.shape, jnp.nan, s.dtype))

    kernel = functools.partial(
        _decode_kernel, num_outputs=len(out_shape), group=group, group_padded=group_padded,
        head_dim_padded=head_dim_padded, pages_per_step=pages_per_step, num_splits=num_splits,
        scale=float(scale), soft_cap=None if soft_cap is None else float(soft_cap))
    outs = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[whole_array_spec(x.shape) for x in inputs],
        out_specs=[whole_array_spec(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=None if interpret else triton_compiler_params(num_warps, num_stages),
        name=f"ferry_paged_decode_g{group}_d{head_dim}_bs{block_size}_k{num_splits}",
    )(*inputs)

    if num_splits == 1:
        return outs[0]
    # Combine the splits (FlashDecoding): rescale every partial to the global max.
    acc, m, l = outs
    m_max = m.max(axis=0)
    w = jnp.exp(m - m_max[None])          # [K, S, Hq]; empty splits have l == 0, acc == 0
    l_sum = (w * l).sum(axis=0)
    o = (w[..., None] * acc).sum(axis=0) / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]
    return o.astype(q.dtype)
