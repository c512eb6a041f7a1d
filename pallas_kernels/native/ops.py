"""The native CPU kernels as JAX ops: XLA FFI calls into the library (pallas_kernels/native/library.py).

  paged_decode_attention_native(q, k_pages, v_pages, block_tables, context_lens, *, scale, soft_cap=None,
                                sliding_window=None, sinks=None)
  paged_prefill_attention_native(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale,
                                 soft_cap=None, sliding_window=None, sinks=None)

take exactly the arguments of the references in pallas_kernels/reference.py and match them (float32
and bfloat16, q and pages of one dtype, or float32 q over bfloat16 pages: a bf16 KV cache under a
float32 model, or quantized int8 / float8_e4m3fn pages (pallas_kernels/kv_quant.py); GQA/MQA; any
head_dim and block size; optional soft cap, sliding window and attention sinks).
`stacked_matmul(x, packed, layer, n=N)` is x @ w[layer] for a [L, K, N] stack of weights (float32 or bfloat16, or
a pallas_kernels.quantized.QuantizedWeight of int8, int4 or uint4 values with per-group scales and offsets) packed once
by `pack_stacked`, reading that layer's panels in place (the scanned decoder layers' linears: XLA CPU copies a
dynamic slice before its library dot). `grouped_matmul(x, packed, first, group_sizes, n=N)` is a mixture of
experts' ragged dot (x's rows sorted by expert, expert e's through stack entry first + e) over every layer's
experts packed as one stack, the layer's experts read in place. `packed_columns` reads columns back from a
packed stack (a tied embedding table from the packed LM head).
`kv_write(pages, updates, slot_mapping)` scatters one step's K or V rows into the pages in place (XLA
CPU's own scatter into a 16-bit float cache rewrites every page). `rms_norm(x, w, eps=, offset=, delta=)` is a
decoder layer's RMSNorm (with delta: the residual add before it) in one call, where XLA CPU runs several
small fusions. They run on the CPU backend only, where library.available().
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native import library
from pallas_kernels.quantized import QuantizedWeight, is_quantized

DECODE_TARGET = "ferry_paged_decode_attention"
PREFILL_TARGET = "ferry_paged_prefill_attention"
KV_WRITE_TARGET = "ferry_kv_write"
STACKED_MATMUL_TARGET = "ferry_stacked_matmul"
RMS_NORM_TARGET = "ferry_rms_norm"
ADD_RMS_NORM_TARGET = "ferry_add_rms_norm"
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------------------- the calls


QUANTIZED_PAGE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # pallas_kernels/kv_quant.py's rows


def supports(q_dtype, page_dtype) -> bool:
    """Whether the native kernels take these dtypes: q and pages of one supported dtype, float32 q
    over bfloat16 pages (read in place and widened per page: no cache copy), or float32 / bfloat16 q over
    quantized pages (int8, float8_e4m3fn: each row its values and float32 scale, dequantized per page)."""
    q_dtype, page_dtype = jnp.dtype(q_dtype), jnp.dtype(page_dtype)
    if page_dtype in QUANTIZED_PAGE_DTYPES:
        return q_dtype in SUPPORTED_DTYPES
    if q_dtype == page_dtype:
        return q_dtype in SUPPORTED_DTYPES
    return q_dtype == jnp.dtype(jnp.float32) and page_dtype == jnp.dtype(jnp.bfloat16)


def _check(target, q, k_pages, v_pages):
    library.require(target)
    if not (supports(q.dtype, k_pages.dtype) and k_pages.dtype == v_pages.dtype):
        raise ValueError(f"native paged attention takes float32 or bfloat16 q and pages of one "
                         f"dtype, bfloat16 pages under float32 q, or int8 / float8_e4m3fn pages; got q {q.dtype}, "
                         f"k {k_pages.dtype}, "
                         f"v {v_pages.dtype}")


def _attrs(scale, soft_cap):
    # soft_cap 0 means "no cap" to the kernel.
    return dict(scale=np.float32(scale), soft_cap=np.float32(0.0 if soft_cap is None else soft_cap))


def _window(sliding_window):
    """The window operand: an int32 scalar (0: none), traced where the layer scan picks it."""
    return jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)


def _sinks(sinks, num_q_heads: int):
    """The sinks operand: float32 [Hq] attention sinks, or [0] (none: the kernels then run as without)."""
    if sinks is None:
        return jnp.zeros((0,), jnp.float32)
    if jnp.shape(sinks) != (num_q_heads,):
        raise ValueError(f"sinks must be [num_q_heads] = [{num_q_heads}], got {jnp.shape(sinks)}")
    return jnp.asarray(sinks, jnp.float32)


def paged_decode_attention_native(q, k_pages, v_pages, block_tables, context_lens, *, scale,
                                  soft_cap=None, sliding_window=None, sinks=None):
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D] (reference semantics)."""
    _check(DECODE_TARGET, q, k_pages, v_pages)
    call = jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, jnp.asarray(block_tables, jnp.int32),
                jnp.asarray(context_lens, jnp.int32), _window(sliding_window), _sinks(sinks, q.shape[1]),
                **_attrs(scale, soft_cap))


def paged_prefill_attention_native(q, k_pages, v_pages, block_tables, context_lens,
                                   query_start_loc, *, scale, soft_cap=None, sliding_window=None, sinks=None):
    """Flat query tokens of several sequences: q [T, Hq, D] -> [T, Hq, D] (reference semantics)."""
    _check(PREFILL_TARGET, q, k_pages, v_pages)
    call = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, jnp.asarray(block_tables, jnp.int32),
                jnp.asarray(context_lens, jnp.int32), _window(sliding_window),
                jnp.asarray(query_start_loc, jnp.int32), _sinks(sinks, q.shape[1]), **_attrs(scale, soft_cap))


def kv_write(pages, updates, slot_mapping):
    """pages [NB, BS, H, D] with row slot_mapping[t] (block * BS + offset) set to updates[t] [T, H, D]
    (cast to the pages' dtype); slots outside the pages are dropped, as `.at[].set(mode="drop")`.
    More leading dims count as more blocks, in order ([L, NB, BS, H, D]: slot (l * NB + block) * BS +
    offset): a caller need not reshape a donated pool, which makes XLA copy it. The output aliases `pages`:
    under a donated cache XLA writes the T rows in place."""
    library.require(KV_WRITE_TARGET)
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, jax.ShapeDtypeStruct(pages.shape, pages.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(pages, updates.astype(pages.dtype), jnp.asarray(slot_mapping, jnp.int32))


GATED_ACTIVATIONS = ("silu", "gelu_tanh")  # the kernel's act attribute: their index
PACKED_RANK = 5  # pack_stacked's [L, P, S, KP, C * E]


def panel_layout() -> tuple[int, int, int]:
    """(columns a panel, columns a strip, strips a panel): the stacked matmul's layout, as the kernels define it."""
    info = library.info()
    return info.panel_cols, info.strip_cols, info.panel_cols // info.strip_cols


def packed_shape(num_layers: int, k: int, n: int, dtype, groups: int = 1) -> tuple[int, ...]:
    """pack_stacked's output shape for a [num_layers, K, N] stack: [L, P, S, KP, C * E] (see pack_stacked)."""
    panel_cols, strip_cols, strips = panel_layout()
    panels = groups * -(-(n // groups) // panel_cols)
    if jnp.dtype(dtype) == jnp.bfloat16:
        return num_layers, panels, strips, (k + 1) // 2, 2 * strip_cols
    return num_layers, panels, strips, k, strip_cols


# ----------------------------------------------------------------------------- quantized weights

QUANTIZED_TARGET = "ferry_stacked_matmul_quantized"
QUANTIZED_KINDS = {"int8": 1, "int4": 2, "uint4": 3}  # the kernel's kind attribute
GROUPED_MATMUL_TARGET = "ferry_grouped_matmul"
GROUPED_QUANTIZED_TARGET = "ferry_grouped_matmul_quantized"


def _is_quantized(w) -> bool:
    return is_quantized(w)


def _panels(a, groups: int):
    """[L, R, N] -> [L, P, 4, R, 16]: each of the `groups` column parts zero-padded to whole panels, every
    panel's strips of 16 columns one after another, each strip's R rows contiguous."""
    panel_cols, strip_cols, strips = panel_layout()
    num_layers, rows, n = a.shape
    if n % groups:
        raise ValueError(f"pack_stacked: N {n} does not split into {groups} equal parts")
    part = n // groups
    per_part = -(-part // panel_cols)
    a = a.reshape(num_layers, rows, groups, part)
    a = jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, per_part * panel_cols - part)))
    return a.reshape(num_layers, rows, groups * per_part, strips, strip_cols).transpose(0, 2, 3, 1, 4)


def _unpanel(a, n: int, groups: int):
    """_panels' inverse: [L, P, 4, R, 16] -> [L, R, n]."""
    num_layers, _, _, rows, _ = a.shape
    a = a.transpose(0, 3, 1, 2, 4).reshape(num_layers, rows, groups, -1)[..., :n // groups]
    return a.reshape(num_layers, rows, n)


def quantized_kind(packed, k: int) -> str:
    """A packed QuantizedWeight's value kind: "int8" (int8 panels of K rows), "int4" (int8 panels of
    ceil(K / 2) rows of nibble pairs) or "uint4" (uint8 panels)."""
    dtype = jnp.dtype(packed.values.dtype)
    if dtype == jnp.uint8:
        return "uint4"
    if dtype != jnp.int8:
        raise ValueError(f"not a packed quantized weight: values {dtype}")
    return "int8" if packed.values.shape[3] == k else "int4"


def _pack_quantized(w, groups: int):
    """pack_stacked for a QuantizedWeight [L, K, N] (see pack_stacked)."""
    values, scales, offsets = w.values, w.scales, w.offsets
    dtype = jnp.dtype(values.dtype)
    if dtype not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
        raise ValueError(f"native stacked matmul takes int8, int4 or uint4 quantized weights; got {dtype} "
                         f"(fp8 and others: dequantize, or the XLA path)")
    if values.ndim != 3 or scales.ndim != 3:
        raise ValueError(f"pack_stacked: a QuantizedWeight stack [L, K, N] needed; got values {values.shape}, "
                         f"scales {scales.shape}")
    num_layers, k, n = values.shape
    k_groups = scales.shape[1]
    if (scales.shape != (num_layers, k_groups, n) or k_groups < 1 or k % k_groups
            or (offsets is not None and offsets.shape != scales.shape)):
        raise ValueError(f"pack_stacked: scales (and offsets) must be [L, G, N] with G dividing K; got values "
                         f"{values.shape}, scales {scales.shape}, "
                         f"offsets {None if offsets is None else offsets.shape}")
    four = dtype != jnp.dtype(jnp.int8)
    if dtype == jnp.dtype(jnp.int4) and k == 1:
        four = False  # one row: int8 holds it, and int8 panels of K rows tell int8 from int4's pairs
    if four and k_groups > 1 and (k // k_groups) % 2:
        raise ValueError(f"pack_stacked: 4-bit values need an even group size (or one group); got "
                         f"{k // k_groups}")
    if not four:
        packed_values = _panels(values.astype(jnp.int8), groups)
    else:
        nibbles = values.astype(jnp.int8).astype(jnp.uint8) & 15  # int4: two's complement nibbles
        nibbles = jnp.pad(nibbles, ((0, 0), (0, k % 2), (0, 0)))
        pairs = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [L, ceil(K / 2), N]
        packed_values = _panels(pairs, groups)
        if dtype == jnp.dtype(jnp.int4):
            packed_values = jax.lax.bitcast_convert_type(packed_values, jnp.int8)
    pack = functools.partial(_panels, groups=groups)
    return QuantizedWeight(packed_values, pack(scales.astype(jnp.float32)),
                           None if offsets is None else pack(offsets.astype(jnp.float32)))


def _unpack_quantized(packed, k: int, n: int, groups: int):
    kind = quantized_kind(packed, k)
    values = _unpanel(packed.values, n, groups)
    if kind != "int8":
        values = values.astype(jnp.uint8)
        pairs = jnp.stack([values & 15, values >> 4], axis=2).reshape(values.shape[0], -1, n)[:, :k]
        values = ((pairs ^ 8).astype(jnp.int8) - 8).astype(jnp.int4) if kind == "int4" else pairs.astype(jnp.uint4)
    unpack = functools.partial(_unpanel, n=n, groups=groups)
    return QuantizedWeight(values, unpack(packed.scales), None if packed.offsets is None else unpack(packed.offsets))


def packed_columns(packed, ids, k: int):
    """Columns `ids` [...] of layer 0 of a packed stack (pack_stacked of [L, K, N], one part), as float32
    [..., K]: a gather of their strips' K rows, dequantized as QuantizedWeight.dequantize does (float(q) * s,
    then + o) for a quantized stack. The tied embedding table read from the packed LM head."""
    panel_cols, strip_cols, strips = panel_layout()
    ids = jnp.asarray(ids, jnp.int32)
    panel, strip, lane = ids // panel_cols, ids % panel_cols // strip_cols, ids % strip_cols

    def column(a):  # [L, P, 4, R, C] -> [..., R, C]
        return a[0, panel, strip]

    if not _is_quantized(packed):
        rows = column(packed)
        if jnp.dtype(packed.dtype) == jnp.bfloat16:  # [..., ceil(K / 2), 32]: lane pairs 2 j, 2 j + 1
            pairs = jnp.take_along_axis(rows.reshape(*rows.shape[:-1], strip_cols, 2),
                                        lane[..., None, None, None], axis=-2)[..., 0, :]
            return pairs.reshape(*ids.shape, -1)[..., :k].astype(jnp.float32)
        return jnp.take_along_axis(rows, lane[..., None, None], axis=-1)[..., 0].astype(jnp.float32)

    def lanes(a):  # [..., R]
        return jnp.take_along_axis(column(a), lane[..., None, None], axis=-1)[..., 0]

    kind = quantized_kind(packed, k)
    values = lanes(packed.values)
    if kind != "int8":
        values = values.astype(jnp.uint8)
        nibbles = jnp.stack([values & 15, values >> 4], axis=-1).reshape(*ids.shape, -1)[..., :k]
        values = (nibbles ^ 8).astype(jnp.int8) - 8 if kind == "int4" else nibbles
    scales = lanes(packed.scales)
    group = k // scales.shape[-1]
    w = values.astype(jnp.float32) * jnp.repeat(scales, group, axis=-1)
    return w if packed.offsets is None else w + jnp.repeat(lanes(packed.offsets), group, axis=-1)


def pack_stacked(w, groups: int = 1):
    """A stack of per-layer weights w [L, K, N] -> the panel-major layout stacked_matmul reads, once at
    load (the weights then stream from memory contiguously, where packing per call read a panel's columns of
    every row of w). `groups` equal parts of the columns (a fused [gate | up]: 2)
    are each zero-padded to whole panels, so a gated call finds the up's panel at a fixed
    offset from the gate's. With C = 64 columns a panel in S = 4 strips of 16 (panel_layout): [L, P, 4, KP, 16 * E],
    panel p holding 64 columns over all of K as 4 strips of 16 columns, one after another (a tile reads a strip's
    k steps as one stream):
      float32: KP = K, [l, p, s, k, j] = w[l, k, c + 16 s + j];
      bfloat16: KP = ceil(K / 2), [l, p, s, k2, 2 j + h] = w[l, 2 k2 + h, c + 16 s + j] (zero past K): the
      pairs of rows a bf16 dot product instruction takes, one 32-bit lane per column.
    A QuantizedWeight stack [L, K, N] (int8, int4 or uint4 values, float32 scales and offsets [L, G, N]) gives
    a QuantizedWeight of panels (matmul.h, "Quantized weights"), its ndim PACKED_RANK:
      values int8: [L, P, 4, K, 16] int8, [l, p, s, k, j] = q[l, k, c + 16 s + j];
      values int4 / uint4: [L, P, 4, ceil(K / 2), 16] int8 / uint8, a byte per pair of rows, the even row in the
      low nibble (int4: two's complement nibbles; zero past K; an int4 stack of K = 1 packs as int8);
      scales, offsets: [L, P, 4, G, 16] float32, [l, p, s, i, j] = scales[l, i, c + 16 s + j].
    fp8 (or any other value dtype) is a ValueError."""
    if _is_quantized(w):
        return _pack_quantized(w, groups)
    num_layers, k, n = w.shape
    panels = _panels(w, groups)  # [L, P, 4, K, 16]
    if jnp.dtype(w.dtype) != jnp.bfloat16:
        return panels
    panels = jnp.pad(panels, ((0, 0), (0, 0), (0, 0), (0, k % 2), (0, 0)))
    num_panels, strips, _, strip_cols = panels.shape[1:]
    panels = panels.reshape(num_layers, num_panels, strips, (k + 1) // 2, 2, strip_cols).swapaxes(-1, -2)
    return panels.reshape(packed_shape(num_layers, k, n, w.dtype, groups))


def unpack_stacked(packed, k: int, n: int, groups: int = 1):
    """pack_stacked's inverse: the [L, K, N] stack (a QuantizedWeight's: a QuantizedWeight, int4 values of
    K = 1 as int8)."""
    if _is_quantized(packed):
        return _unpack_quantized(packed, k, n, groups)
    panel_cols, strip_cols, strips = panel_layout()
    num_layers, panels = packed.shape[:2]
    part = n // groups
    if jnp.dtype(packed.dtype) == jnp.bfloat16:
        w = packed.reshape(num_layers, panels, strips, -1, strip_cols, 2).transpose(0, 3, 5, 1, 2, 4)
        w = w.reshape(num_layers, -1, panels, panel_cols)[:, :k]  # [L, K, P, 64]
    else:
        w = packed.transpose(0, 3, 1, 2, 4).reshape(num_layers, k, panels, panel_cols)
    w = w.reshape(num_layers, k, groups, -1)[..., :part]
    return w.reshape(num_layers, k, n)


def stacked_matmul(x, packed_w, layer, *, n: int, groups: int = 1, gated: str | None = None,
                   dtype=jnp.float32, round_to=None, rows=None):
    """x [..., K] @ w[layer] -> [..., n], float32, where packed_w = pack_stacked(w, groups) for w [L, K, n]
    (float32, or bfloat16: widened exactly as it is read, the sums in float32), x float32 (or bfloat16
    under bfloat16 weights: on a CPU with AVX512-BF16 its pairs of products go through the bf16 dot
    instruction, exact products summed in float32) and an int32 scalar `layer` (clamped into [0, L) like
    a dynamic slice). The kernel reads the layer's panels where they lie in the stack: under
    jax.lax.scan with the stack closed over (not sliced by the scan), no per-step copy of a layer.
    Reference: jnp.dot(x.astype(float32), w[layer].astype(float32)).

    `gated` ("silu" or "gelu_tanh", groups 2): the columns are a fused [gate | up] projection and the
    result is pallas_kernels.ops.gated_activation(sums, dtype) [..., n / 2] in `dtype` (float32 or bfloat16), applied on
    AVX-512 to each panel's sums while they are in cache (no float32 [M, 2I] round trip through memory).

    `round_to` (not gated; None, float32 or bfloat16): the float32 result rounded to that dtype's precision,
    y.astype(round_to).astype(float32) in one pass, as a bf16 LM head's logits reach the sampler (where XLA
    would run two converts of the logits).

    `rows` (an int32 scalar; None: all of them): only x's first `rows` rows (flattened) are computed, the
    rest of the result left unwritten (garbage): a bucketed step's padding rows, which no real row reads.

    A packed QuantizedWeight (pack_stacked of int8, int4 or uint4 values): each weight dequantized in float32 as
    float(q) * s, rounded, then + o, and summed as the float32 path sums, so for float32 x the result is the
    float32 path's on w.dequantize() bit for bit (bfloat16 x: on x widened to float32)."""
    if _is_quantized(packed_w):
        return _stacked_matmul_quantized(x, packed_w, layer, n=n, groups=groups, gated=gated, dtype=dtype,
                                         round_to=round_to, rows=rows)
    library.require(STACKED_MATMUL_TARGET)
    _check_packed(x, packed_w, n, groups)
    width, round_bf16 = _check_epilogue(n, groups, gated, dtype, round_to)
    x2 = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(STACKED_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x2.shape[0], width), dtype if gated else jnp.float32),
                            vmap_method="sequential")
    rows = x2.shape[0] if rows is None else rows
    y = call(x2, packed_w, jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(rows, jnp.int32).reshape(()),
             act=np.int32(-1 if gated is None else GATED_ACTIVATIONS.index(gated)), groups=np.int32(groups),
             round_bf16=np.int32(round_bf16))
    return y.reshape(*x.shape[:-1], width)


def _stacked_matmul_quantized(x, packed, layer, *, n, groups, gated, dtype, round_to, rows):
    """stacked_matmul for a packed QuantizedWeight: x @ dequantize(w[layer]), the float32 path's bits on the
    dequantized weights (bf16 x: on x widened)."""
    library.require(QUANTIZED_TARGET)
    operands, kind = _quantized_operands(x, packed, n, groups)
    width, round_bf16 = _check_epilogue(n, groups, gated, dtype, round_to)
    x2 = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(QUANTIZED_TARGET,
                            jax.ShapeDtypeStruct((x2.shape[0], width), dtype if gated else jnp.float32),
                            vmap_method="sequential")
    rows = x2.shape[0] if rows is None else rows
    y = call(x2, *operands, jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(rows, jnp.int32).reshape(()),
             act=np.int32(-1 if gated is None else GATED_ACTIVATIONS.index(gated)), groups=np.int32(groups),
             round_bf16=np.int32(round_bf16), kind=np.int32(QUANTIZED_KINDS[kind]))
    return y.reshape(*x.shape[:-1], width)


def _check_packed(x, packed_w, n, groups):
    """Raise unless packed_w is a float32 or bfloat16 pack_stacked(w [L, K, n], groups) for x [..., K] (float32,
    or of the weights' dtype)."""
    if packed_w.dtype not in SUPPORTED_DTYPES or x.dtype not in {jnp.dtype(jnp.float32), packed_w.dtype}:
        raise ValueError(f"native stacked matmul takes float32 or bfloat16 weights and float32 x (or x of the "
                         f"weights' dtype); got x {x.dtype}, packed_w {packed_w.dtype}")
    want = (packed_shape(packed_w.shape[0], x.shape[-1], n, packed_w.dtype, groups)
            if packed_w.ndim == PACKED_RANK else None)
    if tuple(packed_w.shape) != want or n % groups:
        raise ValueError(f"native stacked matmul: packed_w must be pack_stacked(w [L, K, {n}], groups={groups}) "
                         f"for x [..., K]; got x {x.shape}, packed_w {packed_w.shape}")


def _quantized_operands(x, packed, n, groups):
    """((values, scales, offsets or [0]), kind): the quantized kernels' weight operands, checked to be a
    pack_stacked(QuantizedWeight [L, K, n], groups) for x [..., K] (float32 or bfloat16)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"native quantized stacked matmul takes float32 or bfloat16 x; got {x.dtype}")
    k = x.shape[-1]
    values, scales, offsets = packed.values, packed.scales, packed.offsets
    if jnp.dtype(values.dtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
        raise ValueError(f"native stacked matmul takes int8, int4 or uint4 quantized weights packed by "
                         f"pack_stacked; got values {values.dtype}")
    kind = quantized_kind(packed, k)
    panel_cols, strip_cols, strips = panel_layout()
    num_layers = values.shape[0] if values.ndim == PACKED_RANK else 0
    panels = groups * -(-(n // groups) // panel_cols)
    want = (num_layers, panels, strips, k if kind == "int8" else (k + 1) // 2, strip_cols)
    k_groups = scales.shape[3] if scales.ndim == PACKED_RANK else 0
    if (tuple(values.shape) != want or n % groups or scales.dtype != jnp.float32 or k_groups < 1 or k % k_groups
            or tuple(scales.shape) != (*want[:3], k_groups, strip_cols)
            or (offsets is not None and (offsets.shape != scales.shape or offsets.dtype != jnp.float32))):
        raise ValueError(f"native stacked matmul: packed_w must be pack_stacked(w [L, K, {n}], groups={groups}) "
                         f"for x [..., K]; got x {x.shape}, values {values.shape}, scales {scales.shape}, "
                         f"offsets {None if offsets is None else offsets.shape}")
    return (values, scales, jnp.zeros((0,), jnp.float32) if offsets is None else offsets), kind


def grouped_matmul(x, packed_w, first, group_sizes, *, n: int, groups: int = 1, gated: str | None = None,
                   dtype=jnp.float32):
    """A mixture of experts' grouped (ragged) matmul over one layer's experts, their panels read where they lie
    in a stack of every layer's: packed_w = pack_stacked(w.reshape(L * E, K, n), groups) for w [L, E, K, n]
    (float32, bfloat16, or a QuantizedWeight as stacked_matmul takes), x [M, K] with its rows sorted by expert
    (float32, or bfloat16 under bfloat16 or quantized weights), `first` an int32 scalar, the stack entry of the
    layer's expert 0 (layer * E; clamped into [0, L * E - E] like a dynamic slice of E entries) and
    `group_sizes` int32 [E]: expert e's rows are [sum(group_sizes[:e]), sum(group_sizes[:e + 1])) (a negative
    size counts as 0; rows past M are dropped), each summed as stacked_matmul(x[rows], packed_w, first + e) sums
    it (the same bits for float32 x). Rows past sum(group_sizes) (other devices' experts, padding) are zeros.
    Reference: jax.lax.ragged_dot(x.astype(float32), w[layer].astype(float32), group_sizes) -> [M, n] float32.

    `gated` ("silu" or "gelu_tanh", groups 2): stacked_matmul's fused [gate | up] activation, [M, n / 2] in
    `dtype` (float32 or bfloat16; the zero rows too). One call runs every expert's panel items on the threads
    together: a decode step's expert has a row or two."""
    quantized = _is_quantized(packed_w)
    target = GROUPED_QUANTIZED_TARGET if quantized else GROUPED_MATMUL_TARGET
    library.require(target)
    if quantized:
        operands, kind = _quantized_operands(x, packed_w, n, groups)
        attrs = dict(kind=np.int32(QUANTIZED_KINDS[kind]))
    else:
        _check_packed(x, packed_w, n, groups)
        operands, attrs = (packed_w,), {}
    entries = operands[0].shape[0]
    if x.ndim != 2 or jnp.ndim(group_sizes) != 1 or not 0 < jnp.shape(group_sizes)[0] <= entries:
        raise ValueError(f"native grouped matmul takes x [M, K] and group_sizes [E] with 0 < E <= the stack's "
                         f"{entries} entries; got x {x.shape}, group_sizes {jnp.shape(group_sizes)}")
    width, _ = _check_epilogue(n, groups, gated, dtype, None)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], width), dtype if gated else jnp.float32),
                            vmap_method="sequential")
    return call(x, *operands, jnp.asarray(first, jnp.int32).reshape(()), jnp.asarray(group_sizes, jnp.int32),
                act=np.int32(-1 if gated is None else GATED_ACTIVATIONS.index(gated)), groups=np.int32(groups),
                **attrs)


def _check_epilogue(n, groups, gated, dtype, round_to):
    """(the result's width, whether it rounds to bfloat16) for stacked_matmul's gated, dtype and round_to."""
    width = n
    round_bf16 = round_to is not None and jnp.dtype(round_to) == jnp.bfloat16
    if round_to is not None and (gated is not None or jnp.dtype(round_to) not in SUPPORTED_DTYPES):
        raise ValueError(f"native stacked matmul: round_to is float32 or bfloat16, and not gated; got "
                         f"{round_to!r}, gated {gated!r}")
    if gated is not None:
        if gated not in GATED_ACTIVATIONS or groups != 2 or jnp.dtype(dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"native gated stacked matmul: act one of {GATED_ACTIVATIONS}, groups 2 and a "
                             f"float32 or bfloat16 dtype needed; got {gated!r}, groups {groups}, {jnp.dtype(dtype)}")
        width //= 2
    return width, round_bf16


def rms_norm(x, weight, *, eps: float, offset: float = 0.0, delta=None):
    """RMSNorm over x's last axis, as models.transformer.RMSNorm rounds it: in float32
    v * rsqrt(mean(v^2) + eps), then weight * normed.astype(dtype) (offset 0: Llama) or
    (normed * (offset + weight)).astype(dtype) (Gemma: offset 1). x float32 or bfloat16, weight [K] of
    x's dtype. With `delta` (x's shape; float32, e.g. a matmul's sums, or x's dtype), v is the residual
    add x + delta.astype(x.dtype), and the result is (normed, v). Reference: models.transformer.RMSNorm."""
    library.require(RMS_NORM_TARGET if delta is None else ADD_RMS_NORM_TARGET)
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"native rms norm takes float32 or bfloat16 x and weight [K] of its dtype; got x "
                         f"{x.dtype}{list(x.shape)}, weight {weight.dtype}{list(weight.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    like = jax.ShapeDtypeStruct(rows.shape, x.dtype)
    attrs = dict(eps=np.float32(eps), offset=np.float32(offset))
    if delta is None:
        out = jax.ffi.ffi_call(RMS_NORM_TARGET, like, vmap_method="sequential")(rows, weight, **attrs)
        return out.reshape(x.shape)
    if delta.shape != x.shape or delta.dtype not in {jnp.dtype(jnp.float32), x.dtype}:
        raise ValueError(f"native add rms norm: delta must have x's shape {list(x.shape)} and be float32 or "
                         f"{x.dtype}; got {delta.dtype}{list(delta.shape)}")
    total, out = jax.ffi.ffi_call(ADD_RMS_NORM_TARGET, (like, like), vmap_method="sequential")(
        rows, delta.reshape(rows.shape), weight, **attrs)
    return out.reshape(x.shape), total.reshape(x.shape)
