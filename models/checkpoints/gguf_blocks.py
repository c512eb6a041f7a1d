"""GGUF quantized blocks repacked, not dequantized: each block type's integer codes, per-group float32 scale and
offset, laid out as a `models.quantization.QuantizedWeight` reads them, so that

    values * scales + offsets   (float32, the product rounded, then the sum)

gives bit for bit the float32 weights gguf.quants.dequantize computes (its numpy arithmetic, block by block):

  type   gguf.quants' formula               values            group  scales       offsets
  Q8_0   x * d                              int8  x           32     d            -
  Q4_0   d * (q - 8)                        int4  q - 8       32     d            -
  Q4_1   d * q + m                          uint4 q           32     d            m
  Q5_0   d * (q - 16)                       int8  q - 16      32     d            -
  Q5_1   d * q + m                          int8  q (0..31)   32     d            m
  Q4_K   (d * sc) * q - (dmin * m)          uint4 q           32     d * sc       -(dmin * m)
  Q5_K   (d * sc) * q - (dmin * m)          int8  q (0..31)   32     d * sc       -(dmin * m)
  Q6_K   (d * sc) * (q - 32)                int8  q - 32      16     d * sc       -

(d, dmin, m: the block's float16 fields as float32; sc, m of the K-quants: 6-bit sub-block codes; x - y and
x + (-y) are the same IEEE result). Every other type (F32, F16, BF16, Q2_K, Q3_K, the IQ and TQ types, MXFP4)
is dequantized by the caller.

Arrays come back in GGUF's (torch's) row order: values [rows, cols], scales and offsets [rows, cols // group],
the groups along a row (a Linear's input): the transpose of Ferry's [in, out] kernel.
"""

import ml_dtypes
import numpy as np

# GGML type name -> (block elements, block bytes, group)
REPACKED = {"Q8_0": (32, 34, 32), "Q4_0": (32, 18, 32), "Q4_1": (32, 20, 32), "Q5_0": (32, 22, 32),
            "Q5_1": (32, 24, 32), "Q4_K": (256, 144, 32), "Q5_K": (256, 176, 32), "Q6_K": (256, 210, 16)}


def can_repack(kind_name: str, shape: tuple[int, ...]) -> bool:
    """A matrix of a repacked type whose rows hold whole blocks."""
    return kind_name in REPACKED and len(shape) == 2 and shape[-1] % REPACKED[kind_name][0] == 0


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of each block, as float32 [n]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: each run of `span` bytes gives its `span` low nibbles, then its high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, span) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _high_bits(qh: np.ndarray, count: int, width: int) -> np.ndarray:
    """[n, bytes] -> [n, count, bytes]: bit field i (`width` bits at i * width) of every byte."""
    shifts = (np.arange(count, dtype=np.uint8) * width).reshape(1, count, 1)
    return (qh[:, None, :] >> shifts) & np.uint8((1 << width) - 1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and minimums -> (sc, m), uint8 [n, 8] each."""
    d, m, m_d = (scales[:, 4 * i:4 * i + 4] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (one little-endian uint32) -> uint8 [n, 32]."""
    bits = np.ascontiguousarray(qh).view("<u4")  # [n, 1]
    return ((bits >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b, 0)[:, None], None


def _q4_0(b):
    return (_nibbles(b[:, 2:], 16).astype(np.int8) - np.int8(8)).astype(ml_dtypes.int4), _f16(b, 0)[:, None], None


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).astype(ml_dtypes.uint4), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _q5_0(b):
    q = _nibbles(b[:, 6:], 16) | (_q5_high(b[:, 2:6]) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(b, 0)[:, None], None


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16) | (_q5_high(b[:, 4:8]) << np.uint8(4))
    return q.astype(np.int8), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _k_scales(b):
    sc, mins = _k_scale_min(b[:, 4:16])
    scales = _f16(b, 0)[:, None] * sc.astype(np.float32)
    return scales, -(_f16(b, 2)[:, None] * mins.astype(np.float32))


def _q4_k(b):
    return (_nibbles(b[:, 16:], 32).astype(ml_dtypes.uint4), *_k_scales(b))


def _q5_k(b):
    low = _nibbles(b[:, 48:], 32).reshape(-1, 8, 32)
    q = low | (_high_bits(b[:, 16:48], 8, 1) << np.uint8(4))
    return (q.reshape(b.shape[0], -1).astype(np.int8), *_k_scales(b))


def _q6_k(b):
    low = _nibbles(b[:, :128], 64).reshape(-1, 8, 32)
    high = _high_bits(b[:, 128:192].reshape(-1, 32), 4, 2).reshape(-1, 8, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(b.shape[0], -1), scales, None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def repack(data: np.ndarray, kind_name: str, shape: tuple[int, int]):
    """A GGUF matrix's raw bytes (uint8 [rows, bytes per row]) of type `kind_name` -> (values [rows, cols],
    scales [rows, cols // group] float32, offsets like scales or None); see the module docstring."""
    if not can_repack(kind_name, shape):
        raise ValueError(f"cannot repack a {kind_name} tensor of shape {list(shape)}")
    block, block_bytes, group = REPACKED[kind_name]
    rows, cols = shape
    blocks = np.asarray(data).reshape(rows * (cols // block), block_bytes)
    values, scales, offsets = _DECODERS[kind_name](blocks)
    values = values.reshape(rows, cols)
    scales = np.ascontiguousarray(scales, np.float32).reshape(rows, cols // group)
    if offsets is not None:
        offsets = np.ascontiguousarray(offsets, np.float32).reshape(rows, cols // group)
    return values, scales, offsets
