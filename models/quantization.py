"""Weight-only quantized linears: a `QuantizedWeight` holds a kernel [..., K, N] as small integer (or fp8) values
with a float32 scale, and optionally an offset, per group of `group_size` rows of K and per column:

    w[..., k, n] = values[..., k, n] * scales[..., k // group_size, n] + offsets[..., k // group_size, n]

rounded as written (the product, then the sum): the same float32 weights numpy computes from a GGUF block
(gguf.quants), so a GGUF file served packed gives the dequantized file's weights exactly. The one form holds
every format Ferry reads or makes:

  int8  per output channel (group_size K), symmetric     --quantization=int8, W8A16 checkpoints, GGUF Q8_0 (g32)
  uint4 groups of 32/64/128 with offsets (the minimum)  --quantization=int4
  int4  groups with offsets (zero points) or none        W4A16/AWQ/GPTQ, GGUF Q4_0 (g32)
  uint4 groups with offsets (a block's minimum)          GGUF Q4_1, Q4_K (g32)
  int8  groups with offsets                              GGUF Q5_K (g32), Q6_K (g16)
  float8_e4m3fn per output channel                       --quantization=fp8, FP8 checkpoints

`quantized_matmul` is the XLA path (TPU, GPU, and the CPU where the native kernels do not run): it converts
the values inside the dot, so the weights stay packed in memory. On the CPU the native stacked matmul reads
packed int8/int4 panels instead (pallas_kernels/native/ops.py, pack_stacked).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized import VALUE_BITS, QuantizedWeight, dequantize, is_quantized  # noqa: F401 (the API)

QUANTIZATIONS = ("int8", "int4", "fp8")  # --quantization: what a float checkpoint becomes on load
DEFAULT_GROUP_SIZE = 128  # int4's group along K (AWQ's and GPTQ's usual)
GROUP_SIZES = (16, 32, 64, 128, 256)


def quantized_matmul(x, w: QuantizedWeight):
    """x [..., K] @ w, float32 sums. Two forms, both converting the values inside the step (the weights stay
    packed in memory), as XLA TPU fuses them (scripts/aot_compile.py --quantization measures the step):
      the weights dequantized in float32, cast to x's dtype, then the dot: per output channel (one group) XLA
        fuses the dequantization into the dot's operand (half bf16's bytes for int8); grouped, it writes the
        dequantized layer out once per step;
      grouped, where the rows are few (decode: rows x groups <= K): per-group partial dots [rows, groups, N]
        of the raw values, scaled and summed, plus the offsets' share sum(x over the group) @ offsets."""
    k, n = w.shape[-2:]
    groups = w.scales.shape[-2]
    rows = math.prod(x.shape[:-1])
    if groups == 1 or rows * groups > k:
        dense = w.dequantize().astype(x.dtype)
        return jax.lax.dot_general(x, dense, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    xg = x.reshape(rows, groups, k // groups)
    part = jnp.einsum("tgk,gkn->tgn", xg, w.values.reshape(groups, k // groups, n).astype(x.dtype),
                      preferred_element_type=jnp.float32)
    y = jnp.einsum("tgn,gn->tn", part, w.scales)
    if w.offsets is not None:
        y = y + jnp.sum(xg.astype(jnp.float32), axis=-1) @ w.offsets
    return y.reshape(*x.shape[:-1], n)


def quantized_embedding(table: QuantizedWeight, ids):
    """Rows `ids` of a quantized embedding table [V, D] (stored transposed, as QuantizedWeight [D, V]: its
    groups along D, one column per token), float32 [..., D]."""
    values = jnp.take(table.values, ids, axis=-1)  # [D, ...]
    scales = jnp.take(table.scales, ids, axis=-1)
    offsets = None if table.offsets is None else jnp.take(table.offsets, ids, axis=-1)
    rows = dequantize(values.reshape(values.shape[0], -1), scales.reshape(scales.shape[0], -1),
                      None if offsets is None else offsets.reshape(offsets.shape[0], -1))
    return rows.T.reshape(*jnp.shape(ids), values.shape[0])


# ----------------------------------------------------------------------------- quantizing a float kernel


def quantize(w, method: str, group_size: int | None = None, stacked: bool = False) -> QuantizedWeight:
    """A float kernel [K, N] ([L, K, N] if `stacked`: per layer) quantized weight-only by qwix's calibration:
      int8: symmetric, per output channel (absmax);
      int4: asymmetric, groups of `group_size` rows of K: uint4 codes over each group's [min, max]
            (_quantize_min_max; qwix's integer zero point does not fit, see there);
      fp8:  float8_e4m3fn, symmetric, per output channel."""
    import qwix  # noqa: PLC0415

    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {method!r}")
    w = jnp.asarray(w, jnp.float32)
    k_axis = w.ndim - 2
    channels = [w.ndim - 1] + ([0] if stacked else [])
    if method == "int4":
        group_size = group_size or DEFAULT_GROUP_SIZE
        while w.shape[k_axis] % group_size and group_size > 16:  # the largest power-of-two group K holds
            group_size //= 2
        if w.shape[k_axis] % group_size:
            group_size = w.shape[k_axis]
        return _quantize_min_max(w, group_size)
    qtype = jnp.int8 if method == "int8" else jnp.float8_e4m3fn
    q = qwix.quantize(w, qtype, channelwise_axes=channels)
    return QuantizedWeight(q.qvalue, q.scale.astype(jnp.float32))


def _quantize_min_max(w, group_size: int) -> QuantizedWeight:
    """4-bit with each group's own range: uint4 codes over [min, max] in 15 steps, the offset the group's
    minimum in float32, as GGUF's Q4_1 and AWQ store it. qwix's asymmetric form keeps an integer zero point
    instead (and 0 inside the range), which cannot hold a float minimum: re-quantizing a 4-bit grid in its own
    groups moved every weight off it (SmolLM2's held-out perplexity +37% at groups of 32, where this form
    reproduces the grid)."""
    *lead, k, n = w.shape
    groups = w.reshape(*lead, k // group_size, group_size, n)
    low, high = groups.min(axis=-2), groups.max(axis=-2)
    scales = (high - low) / 15
    scales = jnp.where(scales > 0, scales, 1.0)
    codes = jnp.clip(jnp.round((groups - low[..., None, :]) / scales[..., None, :]), 0, 15)
    return QuantizedWeight(codes.reshape(w.shape).astype(jnp.uint4), scales, low)


# ----------------------------------------------------------------------------- putting kernels together


def common_format(parts: list) -> list:
    """Parts made alike so that they concatenate or stack: one value dtype (a mix of 4-bit kinds, or of
    4- and 8-bit, as int8), one group size (the smallest; larger groups' scales repeated), offsets on all
    or none (zeros where a part has none); float and quantized parts: all float. A GGUF Q4_K_M file mixes
    Q4_K and Q6_K tensors, within one fused projection and across layers."""
    quantized = [p for p in parts if is_quantized(p)]
    if not quantized:
        return parts
    if len(quantized) != len(parts):  # a GGUF's float tensor beside quantized ones: all of them float
        dtype = next(p.dtype for p in parts if not is_quantized(p))
        return [p.dequantize(dtype) if is_quantized(p) else p for p in parts]
    dtypes = {jnp.dtype(p.values.dtype) for p in parts}
    if jnp.dtype(jnp.float8_e4m3fn) in dtypes and len(dtypes) > 1:
        raise ValueError(f"cannot combine fp8 with integer kernels: {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.int8)
    group = min(p.group_size for p in parts)
    with_offsets = any(p.offsets is not None for p in parts)
    out = []
    for p in parts:
        repeat = p.group_size // group
        scales = np.repeat(np.asarray(p.scales), repeat, axis=-2)
        offsets = (None if not with_offsets else np.zeros_like(scales) if p.offsets is None
                   else np.repeat(np.asarray(p.offsets), repeat, axis=-2))
        out.append(QuantizedWeight(np.asarray(p.values).astype(dtype), scales, offsets))
    return out


def concatenate(parts: list, axis: int = -1):
    """jnp.concatenate for float kernels or QuantizedWeights (along N)."""
    parts = common_format(parts)
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=axis), *parts)


def stack(parts: list):
    """jnp.stack over layers for float kernels or QuantizedWeights."""
    parts = common_format(parts)
    return jax.tree.map(lambda *a: jnp.stack(a), *parts)


def split(tensor, indices: list[int], axis: int = -1) -> list:
    """np.split along N for float kernels or QuantizedWeights."""
    if not is_quantized(tensor):
        return np.split(np.asarray(tensor), indices, axis=axis)
    pieces = [np.split(np.asarray(a), indices, axis=axis) if a is not None else [None] * (len(indices) + 1)
              for a in (tensor.values, tensor.scales, tensor.offsets)]
    return [QuantizedWeight(*abc) for abc in zip(*pieces)]


# ----------------------------------------------------------------------------- accounting


def leaf_bytes(leaf) -> int:
    """Bytes a parameter leaf takes: 4-bit values at half a byte each (as XLA packs them on TPU and GPU, and
    the native panels do)."""
    if is_quantized(leaf):
        return sum(leaf_bytes(a) for a in (leaf.values, leaf.scales, leaf.offsets) if a is not None)
    bits = VALUE_BITS.get(jnp.dtype(leaf.dtype), jnp.dtype(leaf.dtype).itemsize * 8)
    return (int(np.prod(leaf.shape)) * bits + 7) // 8


def weight_bytes(state) -> int:
    """The model's parameter bytes, quantized leaves as stored."""
    leaves = jax.tree.leaves(state, is_leaf=is_quantized)
    return sum(leaf_bytes(leaf) for leaf in leaves if hasattr(leaf, "shape"))
