"""What the Pallas (Triton) paged-attention kernels share: paged_attention.py (decode) and
prefill_attention.py (chunked prefill).

  * compat helpers that guard the Pallas API differences between jax releases (Triton compiler
    params, block specs, masked loads and stores);
  * padding to powers of two and the tuning defaults (keys per loop step, warps, stages);
  * the kernels' inner loop: masked gathers of K/V pages through the block table and the
    online-softmax (flash attention) accumulation over them;
  * the wrapper side: checking the paged cache against q, and the pallas_call over whole-array
    blocks with NaN-poisoned outputs in interpret mode.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_quant import SCALE_ELEMS, is_quantized
from pallas_kernels.triton import tuned_block_sizes

try:  # jax >= 0.4.3x: the Triton backend lives in pallas.triton
    from jax.experimental.pallas import triton as plgpu
except ImportError:
    try:  # older releases called it pallas.gpu
        from jax.experimental.pallas import gpu as plgpu
    except ImportError:  # deprecated in jax 0.11: once it is gone, GPUs run jax_triton_attention.py
        plgpu = None

MASK_VALUE = -1e30  # finite, so masked scores never make inf - inf = NaN in the softmax
MIN_DOT_DIM = 16  # Triton's tl.dot needs every operand dimension >= 16
NO_WINDOW_KEY = -(2**30)  # first_visible_key without a window: below every key position (and no overflow)


# ----------------------------------------------------------------------------- compat helpers


def pallas_triton_available() -> bool:
    """Whether this jax still has Pallas' Triton backend (deprecated in 0.11)."""
    return plgpu is not None


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


# ----------------------------------------------------------------------------- padding and tuning


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kernel_tuning(block_size: int, head_dim_padded: int, dtype, *, decode: bool, pages_per_step: int | None,
                  num_warps: int | None, num_stages: int | None, compute_capability: int | None):
    """(pages_per_step, num_warps, num_stages, rows): the given ones, and for those None the tuned table's
    (tuned_block_sizes.py) for `compute_capability` (None: the local GPU's, sm_90 without one): whole pages of its
    keys a step (these kernels step over pages), its warps and stages; rows: its query rows a prefill tile.
    float32 steps half the table's keys: these kernels' address arithmetic keeps more registers live than the
    jax-triton kernel's, and ptxas spills float32 tiles of the full width (tests/pallas_kernels/test_gpu_compile.py)."""
    blocks = tuned_block_sizes.lookup(compute_capability or gpu_compute_capability(), decode=decode, dtype=dtype,
                                      head_dim_padded=head_dim_padded, block_size=block_size)
    if pages_per_step is None:
        keys = blocks.tile_keys // 2 if jnp.dtype(dtype).itemsize >= 4 else blocks.tile_keys
        pages_per_step = max(1, keys // block_size, MIN_DOT_DIM // block_size)
    if pages_per_step * block_size < MIN_DOT_DIM or pages_per_step & (pages_per_step - 1):
        raise ValueError(f"pages_per_step={pages_per_step} must be a power of two giving >= 16 keys")
    return (pages_per_step, num_warps or blocks.num_warps, num_stages or blocks.num_stages, blocks.rows)


def choose_num_splits(programs: int, max_steps: int, num_cores: int) -> int:
    """Split-K (FlashDecoding) shares of each sequence's keys, for a decode launch of `programs` (sequence, KV
    head) programs whose longest context is `max_steps` loop steps: enough that the programs fill the GPU's
    `num_cores` SMs twice over, each share keeping at least ~4 loop steps; a power of two, at most 16."""
    if programs >= 2 * num_cores:
        return 1
    wanted = -(-2 * num_cores // programs)
    splits = max(1, min(wanted, max_steps // 4, 16))
    return 1 << (splits.bit_length() - 1)  # power of two, rounded down


def combine_splits(acc, m, l, sinks, dtype):
    """Split-K's partials -> the attention output: acc [K, ..., D] float32 (unnormalised), m / l [K, ...] each
    split's running max and sum; every partial rescaled to the global max (FlashDecoding). sinks: None, or
    float32 [Hq] (the last axis of m): one more logit of each head, in the denominator only."""
    m_max = m.max(axis=0)
    if sinks is not None:
        m_max = jnp.maximum(m_max, sinks)
    w = jnp.exp(m - m_max[None])  # empty splits have l == 0, acc == 0
    l_sum = (w * l).sum(axis=0)
    if sinks is not None:
        l_sum = l_sum + jnp.exp(sinks - m_max)
    o = (w[..., None] * acc).sum(axis=0) / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]
    return o.astype(dtype)


def gpu_compute_capability(default: int = 90) -> int:
    """The local GPU's compute capability as an integer (H100: 90, A100: 80, L4: 89); `default` without one."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return default
    version = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if not version:
        return default
    major, _, minor = str(version).partition(".")
    return int(major) * 10 + int(minor or 0)


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


# ----------------------------------------------------------------------------- sliding window


def first_visible_key(q_pos, sliding_window):
    """The first key position a query at q_pos sees under `sliding_window` (an int32 scalar, 0 = none):
    q_pos - W + 1, negative near the start; NO_WINDOW_KEY without a window. A query at q_pos + i sees keys from
    this + i, so one value per query tile says where each of its rows starts."""
    window = jnp.asarray(sliding_window, jnp.int32)
    return jnp.where(window > 0, q_pos - window + 1, NO_WINDOW_KEY)


def first_window_page(first_key, block_size: int, num_pages):
    """The logical page holding key `first_key` (pages before it are wholly outside the window: their table
    entries may be garbage and are never read), at most num_pages."""
    return jnp.minimum(lax.div(jnp.maximum(first_key, 0), block_size), num_pages)


# ----------------------------------------------------------------------------- inside the kernels


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


def attend_pages(q, k_ref, v_ref, tables_ref, seq, kv_head, *, first_page=None, end_page, kv_len,
                 num_steps, pages_per_step, feature, feature_ok, key_mask, scale, soft_cap, row_sinks=None):
    """Flash attention of q [M, Dp] over logical pages [first_page, end_page) of sequence `seq`,
    KV head `kv_head`, `pages_per_step` pages a lax.fori_loop step, num_steps steps.

    Page ids come from tables_ref[seq] by a masked gather (logical pages at or past end_page read
    none); keys at positions >= kv_len are masked off and loaded as zeros, so garbage (NaN
    included) in unused slots cannot leak. feature [Dp] holds the feature index of each column,
    clamped into bounds, and feature_ok [Dp] says which are real. key_mask(key_ok [tile],
    key_pos [tile]) gives the [M, tile] bool mask of the keys each row sees. first_page None
    means 0. row_sinks: None, or [M] f32, each row's attention sink (reference.py), which starts its online
    softmax as one key already seen with no value: m = sink, l = 1 (sink_start). Returns (acc [M, Dp] f32,
    running max m [M] f32, running sum l [M] f32).

    Quantized pages (int8, float8_e4m3fn; pallas_kernels/kv_quant.py: a row's D values, then its float32
    scale's 4 bytes) are gathered the same way, with each key's scale (load_scales), and dequantized to q's
    dtype before the dots: value * scale, in float32 first.
    """
    quantized = is_quantized(k_ref.dtype)
    head_dim = k_ref.shape[3] - SCALE_ELEMS if quantized else None
    block_size, table_width = k_ref.shape[1], tables_ref.shape[1]
    rows, head_dim_padded = q.shape
    t = jnp.arange(pages_per_step * block_size)
    page_in_step, slot = t // block_size, t % block_size
    precision = dot_precision(q.dtype)

    def body(step, carry):
        step_start = step * pages_per_step
        if first_page is not None:
            step_start = first_page + step_start
        logical_page = step_start + page_in_step  # [tile]
        page_ok = logical_page < end_page
        page = masked_load(tables_ref, (seq, jnp.minimum(logical_page, table_width - 1)),
                           page_ok, 0)  # unused entries -> page 0 (never dereferenced unmasked)
        key_pos = logical_page * block_size + slot
        key_ok = page_ok & (key_pos < kv_len)  # [tile]
        kv_idx = (page[:, None], slot[:, None], kv_head, feature[None, :])
        kv_mask = key_ok[:, None] & feature_ok[None, :]
        if quantized:  # no `other` (Triton casts no constant to float8): the masked lanes are zeroed after
            k = dequantized_load(k_ref, kv_idx, kv_mask, page, slot, kv_head, head_dim, key_ok, q.dtype)
            v = dequantized_load(v_ref, kv_idx, kv_mask, page, slot, kv_head, head_dim, key_ok, q.dtype)
        else:
            k = masked_load(k_ref, kv_idx, kv_mask, 0)  # [tile, Dp]; masked keys are zeros ...
            v = masked_load(v_ref, kv_idx, kv_mask, 0)  # ... so NaN in unused slots cannot leak
        return online_softmax_step(q, k, v, key_mask(key_ok, key_pos), carry, scale=scale,
                                   soft_cap=soft_cap, precision=precision)

    acc = jnp.zeros((rows, head_dim_padded), jnp.float32)
    if row_sinks is None:
        m, l = jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
    else:
        m, l = sink_start(row_sinks)
    return lax.fori_loop(0, num_steps, body, (acc, m, l))


def sink_start(row_sinks):
    """The online softmax's (running max, running sum) for rows whose attention sinks are row_sinks [M] f32: the
    sink counts as a key already seen, exp(sink - m) = 1 in the sum, that adds nothing to the accumulator. A row
    that then sees no key has acc 0 and l 1: zeros, as without sinks."""
    return row_sinks.astype(jnp.float32), jnp.ones(row_sinks.shape, jnp.float32)


def load_row_sinks(sinks_ref, head, row_ok):
    """Each row's sink from sinks_ref [Hq] f32 (head [M]: the row's query head, row_ok: which rows are real;
    the rest read 0, never stored)."""
    return masked_load(sinks_ref, (jnp.minimum(head, sinks_ref.shape[0] - 1),), row_ok, 0.0)


def check_sinks(sinks, num_q_heads: int):
    """sinks (None, or [Hq]) as float32; a ValueError for any other shape."""
    if sinks is None:
        return None
    if jnp.shape(sinks) != (num_q_heads,):
        raise ValueError(f"sinks must be [num_q_heads] = [{num_q_heads}], got {jnp.shape(sinks)}")
    return jnp.asarray(sinks, jnp.float32)


def dequantized_load(pages_ref, idx, mask, page, slot, kv_head, head_dim: int, key_ok, dtype):
    """Quantized page rows [tile, Dp] at `idx` as value * scale in `dtype` (float32 first), zeros where not
    `mask`. Each row's float32 scale: its 4 bytes after the head_dim values, gathered one byte at a time (a page
    holds no float32 to load), put together little-endian as uint32 and bitcast (same-width bitcasts and
    shifts: what Triton has)."""
    values = masked_load(pages_ref, idx, mask, None)
    word = jnp.zeros(page.shape, jnp.uint32)
    for byte in range(SCALE_ELEMS):
        b = masked_load(pages_ref, (page, slot, kv_head, head_dim + byte), key_ok, None)
        b = lax.bitcast_convert_type(b, jnp.uint8).astype(jnp.uint32)
        word = word | (b << (8 * byte))
    scale = lax.bitcast_convert_type(word, jnp.float32)
    return jnp.where(mask, values.astype(jnp.float32) * scale[:, None], 0.0).astype(dtype)


def normalise(acc, l):
    """acc / l, with rows that saw no key (l == 0) giving zeros instead of NaN."""
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]


# ----------------------------------------------------------------------------- wrappers


def paged_cache_dims(q, k_pages, v_pages):
    """(block_size, num_kv_heads) of k_pages/v_pages [N, block_size, Hkv, D], checked against
    q [rows, Hq, D]."""
    num_q_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, head_dim_k = k_pages.shape
    if is_quantized(k_pages.dtype):  # each row's scale after the values (pallas_kernels/kv_quant.py)
        head_dim_k -= SCALE_ELEMS
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype or head_dim_k != head_dim:
        raise ValueError(f"q {q.shape} / k_pages {k_pages.shape} / v_pages {v_pages.shape} mismatch")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads not divisible by {num_kv_heads} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return block_size, num_kv_heads


def call_kernel(kernel, inputs, out_shape, *, grid, interpret: bool, num_warps: int,
                num_stages: int, name: str):
    """pl.pallas_call of `kernel` on whole-array blocks of `inputs`, outputs `out_shape` (a list).

    In interpret mode every output starts as a NaN-filled buffer aliased into the call (the
    kernel gets it as an extra input before the outputs), so an element it fails to write shows
    up; on GPU the Triton compiler params select the Triton backend.
    """
    inputs = list(inputs)
    aliases = {}
    if interpret:  # poison: every output element the kernel does not write stays NaN
        for i, s in enumerate(out_shape):
            aliases[len(inputs)] = i
            inputs.append(jnp.full(s.shape, jnp.nan, s.dtype))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole_array_spec(x.shape) for x in inputs],
        out_specs=[whole_array_spec(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=None if interpret else triton_compiler_params(num_warps, num_stages),
        name=name,
    )(*inputs)
