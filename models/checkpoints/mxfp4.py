"""gpt-oss's MXFP4 expert weights (config.json quantization_config.quant_method "mxfp4"), dequantized on load.

Each expert projection is stored as `<name>_blocks` uint8 [E, N, G, 16] (two 4-bit e2m1 codes a byte, the low
nibble first: 32 values a block of the K inputs) and `<name>_scales` uint8 [E, N, G] (the block's power of two,
biased by 127). The dequantized tensor is [E, K, N], the layout of the checkpoint's float gate_up_proj and
down_proj, as transformers' integrations/mxfp4.convert_moe_packed_tensors computes it. Ferry then holds the
experts as floats (models/moe.py); keeping them packed is the quantized-weights format's next member.
"""

import numpy as np

from models.config import ConfigError

# e2m1: the 16 codes' values (sign bit high)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [E, N, G, 16], scales uint8 [E, N, G] -> float32 [E, G * 32, N]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ConfigError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                          f"([..., G, 16] and [..., G])")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    experts, rows = blocks.shape[:2]
    return values.reshape(experts, rows, -1).transpose(0, 2, 1)


def check_quantization_config(qc: dict, source: str) -> None:
    if qc.get("quant_method") != "mxfp4":
        raise ConfigError(f"{source}: quantization_config.quant_method = {qc.get('quant_method')!r} is not "
                          f"supported for gpt_oss (mxfp4)")


def dequantized_tensors(tensors):
    """The checkpoint's tensors with each `<name>_blocks` / `<name>_scales` pair replaced by `<name>`, dequantized
    (the pair may come in either order, anywhere in the stream)."""
    pending = {}
    for where, name, host in tensors:
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                pair = pending.setdefault(base, {})
                pair[suffix] = host
                if len(pair) == 2:
                    del pending[base]
                    yield where, base, dequantize_mxfp4(pair["_blocks"], pair["_scales"])
                break
        else:
            yield where, name, host
    if pending:
        raise ConfigError(f"MXFP4 tensors without their pair: {sorted(pending)[:3]}")
