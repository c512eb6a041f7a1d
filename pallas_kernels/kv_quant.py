"""The quantized KV cache (EngineConfig.kv_dtype "int8" or "fp8"): its page layout, and quantizing and
dequantizing a page row in jnp (every kernel family reads the layout defined here).

A quantized page row (one token, one KV head) holds the head's D values quantized, then the float32 scale's
4 bytes bitcast into the page dtype, in the platform's byte order (little-endian on every platform Ferry runs
on; lax.bitcast_convert_type's): the pages are [..., Hkv, D + 4] (SCALE_ELEMS more than the model's head_dim).
The scale lives in the row, so everything that moves whole blocks (swap, prefix caching, the block manager)
moves it with its values, and nothing else changes.

  scale = max|x| / QMAX over the row's D values (QMAX 127 for int8, 448 for float8_e4m3fn), 1 for a zero row
  int8: round(x / scale) (to nearest even), clipped to [-127, 127]; fp8: x / scale rounded to float8_e4m3fn
  read: value * scale, in float32 (|error| <= scale / 2 per element for int8)
"""

import jax
import jax.numpy as jnp

# kv_dtype names -> page dtypes (float dtypes pass through jnp.dtype)
QUANTIZED_NAMES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn),
                   "float8_e4m3fn": jnp.dtype(jnp.float8_e4m3fn)}
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
FLOAT_KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SCALE_ELEMS = 4  # a float32 scale's bytes, as 1-byte page elements
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def resolve_kv_dtype(name) -> jnp.dtype:
    """The page dtype a kv_dtype names: "int8", "fp8" (float8_e4m3fn) or a float dtype (float32, bfloat16,
    float16); ValueError for anything else."""
    if isinstance(name, str) and name in QUANTIZED_NAMES:
        return QUANTIZED_NAMES[name]
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in (*FLOAT_KV_DTYPES, *QUANTIZED_DTYPES):
        raise ValueError(f"kv_dtype {name!r} is not supported: expected int8, fp8 (float8_e4m3fn), float32, "
                         f"bfloat16 or float16")
    return dtype


def is_quantized(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) in QUANTIZED_DTYPES


def page_dim(head_dim: int, dtype) -> int:
    """A page row's elements for a head of `head_dim`: the values, and the scale's bytes where quantized."""
    return head_dim + SCALE_ELEMS if is_quantized(dtype) else head_dim


def quantize(x, dtype):
    """x [..., D] (any float) -> page rows [..., D + 4] of `dtype` (int8 or float8_e4m3fn): the values, then
    the row's float32 scale bitcast."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    scaled = jnp.clip(xf / scale, -qmax, qmax)
    values = (jnp.round(scaled) if dtype == jnp.int8 else scaled).astype(dtype)
    scale_bytes = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(scale, jnp.uint8), dtype)  # [..., 1, 4]
    return jnp.concatenate([values, scale_bytes.reshape(*values.shape[:-1], SCALE_ELEMS)], axis=-1)


def split(rows):
    """Page rows [..., D + 4] -> (values [..., D] in the page dtype, scale [..., 1] float32)."""
    scale = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(rows[..., -SCALE_ELEMS:], jnp.uint8),
                                         jnp.float32)
    return rows[..., :-SCALE_ELEMS], scale[..., None]


def dequantize(rows):
    """Page rows [..., D + 4] -> float32 [..., D]: value * scale."""
    values, scale = split(rows)
    return values.astype(jnp.float32) * scale


def read_pages(pages):
    """Pages as the attention reads them: float pages as they are, quantized ones dequantized to float32
    (their head dim then the model's)."""
    return dequantize(pages) if is_quantized(pages.dtype) else pages


def write_rows(new, page_dtype):
    """New K or V rows [..., D] as they are stored in pages of `page_dtype`: quantized, or cast."""
    return quantize(new, page_dtype) if is_quantized(page_dtype) else new.astype(page_dtype)
