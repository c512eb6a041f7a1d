"""Tile sizes, warps and pipeline stages of the jax-triton paged-attention kernel, per GPU architecture.

TUNED maps (architecture, "decode" or "prefill", q's dtype, head_dim padded to a power of two, page size) to the
BlockSizes written by scripts/tune_triton_kernels.py: of its candidates, in its order of preference (more keys and
query rows a step, more pipeline stages), the first that Triton 3.9 compiles for that architecture with ptxas
reporting 0 bytes of spill stores and shared memory within the architecture's per-block limit. It is chosen from
compiles alone (no GPU has timed it yet); tests/pallas_kernels/test_gpu_compile.py recompiles every entry and
checks it still spills nothing and loads K/V with vector loads. Shapes outside the table take `rule`.
"""

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True, slots=True)
class BlockSizes:
    rows: int        # prefill: query rows a tile (block_q x the padded head group); decode: unused (one token)
    tile_keys: int   # keys a loop step (>= 16: Triton's dot)
    num_warps: int
    num_stages: int


ARCHITECTURES = (80, 89, 90)  # A100; L4 / L40S / RTX 40xx (and sm_86's 99 KiB); H100 / H200 (and newer)
# The most shared memory one program may use (the per-block opt-in maximum, bytes).
SHARED_MEMORY = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
HEAD_DIMS = (64, 128, 256)   # head_dim padded to a power of two: 80 and 96 pad to 128
BLOCK_SIZES = (16, 32, 64)   # page sizes
DTYPES = ("bfloat16", "float32")


def architecture(compute_capability: int) -> int:
    """The table's row for a GPU: sm_90 and newer -> 90; sm_86 / 87 / 89 (99 KiB of shared memory a block) -> 89;
    sm_80 -> 80."""
    if compute_capability >= 90:
        return 90
    return 89 if compute_capability >= 86 else 80


def rule(decode: bool, dtype, head_dim_padded: int, block_size: int) -> BlockSizes:
    """Outside the table: 64 keys and query rows a step (32 for float32), 8 warps at head_dim 256."""
    wide = jnp.dtype(dtype).itemsize >= 4
    target = 32 if wide else 64
    num_warps = 8 if head_dim_padded >= 256 else 4
    return BlockSizes(rows=target, tile_keys=target, num_warps=num_warps, num_stages=1 if wide else 2)


def lookup(compute_capability: int, *, decode: bool, dtype, head_dim_padded: int, block_size: int) -> BlockSizes:
    width = "float32" if jnp.dtype(dtype).itemsize >= 4 else "bfloat16"  # float16 tiles as bfloat16's
    key = (architecture(compute_capability), "decode" if decode else "prefill", width, head_dim_padded, block_size)
    return TUNED.get(key) or rule(decode, dtype, head_dim_padded, block_size)


# Written by scripts/tune_triton_kernels.py (Triton 3.9.0).
TUNED: dict[tuple, BlockSizes] = {
    (80, 'decode', 'bfloat16', 64, 16): BlockSizes(16, 64, 4, 3),
    (80, 'decode', 'bfloat16', 64, 32): BlockSizes(16, 64, 4, 3),
    (80, 'decode', 'bfloat16', 64, 64): BlockSizes(16, 64, 4, 3),
    (80, 'decode', 'bfloat16', 128, 16): BlockSizes(16, 64, 4, 3),
    (80, 'decode', 'bfloat16', 128, 32): BlockSizes(16, 64, 4, 3),
    (80, 'decode', 'bfloat16', 128, 64): BlockSizes(16, 64, 4, 3),
    (80, 'decode', 'bfloat16', 256, 16): BlockSizes(16, 64, 8, 2),
    (80, 'decode', 'bfloat16', 256, 32): BlockSizes(16, 64, 8, 2),
    (80, 'decode', 'bfloat16', 256, 64): BlockSizes(16, 64, 8, 2),
    (80, 'decode', 'float32', 64, 16): BlockSizes(16, 32, 4, 2),
    (80, 'decode', 'float32', 64, 32): BlockSizes(16, 32, 4, 2),
    (80, 'decode', 'float32', 64, 64): BlockSizes(16, 32, 4, 2),
    (80, 'decode', 'float32', 128, 16): BlockSizes(16, 32, 4, 1),
    (80, 'decode', 'float32', 128, 32): BlockSizes(16, 32, 4, 1),
    (80, 'decode', 'float32', 128, 64): BlockSizes(16, 32, 4, 1),
    (80, 'decode', 'float32', 256, 16): BlockSizes(16, 32, 4, 1),
    (80, 'decode', 'float32', 256, 32): BlockSizes(16, 32, 4, 1),
    (80, 'decode', 'float32', 256, 64): BlockSizes(16, 32, 4, 1),
    (80, 'prefill', 'bfloat16', 64, 16): BlockSizes(64, 64, 4, 3),
    (80, 'prefill', 'bfloat16', 64, 32): BlockSizes(64, 64, 4, 3),
    (80, 'prefill', 'bfloat16', 64, 64): BlockSizes(64, 64, 4, 3),
    (80, 'prefill', 'bfloat16', 128, 16): BlockSizes(64, 64, 8, 2),
    (80, 'prefill', 'bfloat16', 128, 32): BlockSizes(64, 64, 8, 2),
    (80, 'prefill', 'bfloat16', 128, 64): BlockSizes(64, 64, 8, 2),
    (80, 'prefill', 'bfloat16', 256, 16): BlockSizes(32, 32, 4, 2),
    (80, 'prefill', 'bfloat16', 256, 32): BlockSizes(32, 32, 4, 2),
    (80, 'prefill', 'bfloat16', 256, 64): BlockSizes(32, 32, 4, 2),
    (80, 'prefill', 'float32', 64, 16): BlockSizes(32, 32, 4, 1),
    (80, 'prefill', 'float32', 64, 32): BlockSizes(32, 32, 8, 1),
    (80, 'prefill', 'float32', 64, 64): BlockSizes(32, 32, 4, 1),
    (80, 'prefill', 'float32', 128, 16): BlockSizes(32, 32, 4, 1),
    (80, 'prefill', 'float32', 128, 32): BlockSizes(32, 32, 4, 1),
    (80, 'prefill', 'float32', 128, 64): BlockSizes(32, 32, 4, 1),
    (80, 'prefill', 'float32', 256, 16): BlockSizes(32, 16, 4, 1),
    (80, 'prefill', 'float32', 256, 32): BlockSizes(32, 16, 4, 1),
    (80, 'prefill', 'float32', 256, 64): BlockSizes(32, 32, 8, 1),
    (89, 'decode', 'bfloat16', 64, 16): BlockSizes(16, 64, 4, 3),
    (89, 'decode', 'bfloat16', 64, 32): BlockSizes(16, 64, 4, 3),
    (89, 'decode', 'bfloat16', 64, 64): BlockSizes(16, 64, 4, 3),
    (89, 'decode', 'bfloat16', 128, 16): BlockSizes(16, 64, 4, 3),
    (89, 'decode', 'bfloat16', 128, 32): BlockSizes(16, 64, 4, 2),
    (89, 'decode', 'bfloat16', 128, 64): BlockSizes(16, 64, 4, 2),
    (89, 'decode', 'bfloat16', 256, 16): BlockSizes(16, 32, 4, 3),
    (89, 'decode', 'bfloat16', 256, 32): BlockSizes(16, 32, 4, 3),
    (89, 'decode', 'bfloat16', 256, 64): BlockSizes(16, 32, 4, 3),
    (89, 'decode', 'float32', 64, 16): BlockSizes(16, 32, 4, 2),
    (89, 'decode', 'float32', 64, 32): BlockSizes(16, 32, 4, 1),
    (89, 'decode', 'float32', 64, 64): BlockSizes(16, 32, 4, 2),
    (89, 'decode', 'float32', 128, 16): BlockSizes(16, 32, 4, 1),
    (89, 'decode', 'float32', 128, 32): BlockSizes(16, 32, 8, 1),
    (89, 'decode', 'float32', 128, 64): BlockSizes(16, 32, 4, 1),
    (89, 'decode', 'float32', 256, 16): BlockSizes(16, 16, 8, 1),
    (89, 'decode', 'float32', 256, 32): BlockSizes(16, 32, 8, 1),
    (89, 'decode', 'float32', 256, 64): BlockSizes(16, 32, 4, 1),
    (89, 'prefill', 'bfloat16', 64, 16): BlockSizes(64, 64, 4, 3),
    (89, 'prefill', 'bfloat16', 64, 32): BlockSizes(64, 64, 4, 3),
    (89, 'prefill', 'bfloat16', 64, 64): BlockSizes(64, 64, 4, 3),
    (89, 'prefill', 'bfloat16', 128, 16): BlockSizes(32, 32, 8, 2),
    (89, 'prefill', 'bfloat16', 128, 32): BlockSizes(32, 32, 4, 2),
    (89, 'prefill', 'bfloat16', 128, 64): BlockSizes(16, 16, 4, 1),
    (89, 'prefill', 'bfloat16', 256, 16): BlockSizes(32, 32, 4, 2),
    (89, 'prefill', 'bfloat16', 256, 32): BlockSizes(32, 32, 4, 2),
    (89, 'prefill', 'bfloat16', 256, 64): BlockSizes(32, 32, 4, 2),
    (89, 'prefill', 'float32', 64, 16): BlockSizes(32, 32, 4, 1),
    (89, 'prefill', 'float32', 64, 32): BlockSizes(32, 32, 4, 1),
    (89, 'prefill', 'float32', 64, 64): BlockSizes(32, 32, 4, 1),
    (89, 'prefill', 'float32', 128, 16): BlockSizes(16, 16, 4, 1),
    (89, 'prefill', 'float32', 128, 32): BlockSizes(16, 16, 4, 1),
    (89, 'prefill', 'float32', 128, 64): BlockSizes(16, 16, 4, 1),
    (89, 'prefill', 'float32', 256, 16): BlockSizes(32, 32, 8, 1),
    (89, 'prefill', 'float32', 256, 32): BlockSizes(32, 32, 8, 1),
    (89, 'prefill', 'float32', 256, 64): BlockSizes(32, 32, 8, 1),
    (90, 'decode', 'bfloat16', 64, 16): BlockSizes(16, 64, 4, 3),
    (90, 'decode', 'bfloat16', 64, 32): BlockSizes(16, 64, 4, 3),
    (90, 'decode', 'bfloat16', 64, 64): BlockSizes(16, 64, 4, 3),
    (90, 'decode', 'bfloat16', 128, 16): BlockSizes(16, 64, 4, 3),
    (90, 'decode', 'bfloat16', 128, 32): BlockSizes(16, 64, 4, 3),
    (90, 'decode', 'bfloat16', 128, 64): BlockSizes(16, 64, 4, 3),
    (90, 'decode', 'bfloat16', 256, 16): BlockSizes(16, 32, 4, 3),
    (90, 'decode', 'bfloat16', 256, 32): BlockSizes(16, 64, 8, 2),
    (90, 'decode', 'bfloat16', 256, 64): BlockSizes(16, 64, 8, 2),
    (90, 'decode', 'float32', 64, 16): BlockSizes(16, 32, 4, 2),
    (90, 'decode', 'float32', 64, 32): BlockSizes(16, 32, 4, 2),
    (90, 'decode', 'float32', 64, 64): BlockSizes(16, 32, 4, 2),
    (90, 'decode', 'float32', 128, 16): BlockSizes(16, 32, 8, 1),
    (90, 'decode', 'float32', 128, 32): BlockSizes(16, 16, 4, 1),
    (90, 'decode', 'float32', 128, 64): BlockSizes(16, 32, 8, 1),
    (90, 'decode', 'float32', 256, 16): BlockSizes(16, 32, 8, 1),
    (90, 'decode', 'float32', 256, 32): BlockSizes(16, 32, 8, 1),
    (90, 'decode', 'float32', 256, 64): BlockSizes(16, 32, 8, 1),
    (90, 'prefill', 'bfloat16', 64, 16): BlockSizes(64, 64, 4, 3),
    (90, 'prefill', 'bfloat16', 64, 32): BlockSizes(64, 64, 4, 3),
    (90, 'prefill', 'bfloat16', 64, 64): BlockSizes(64, 64, 4, 3),
    (90, 'prefill', 'bfloat16', 128, 16): BlockSizes(64, 64, 4, 3),
    (90, 'prefill', 'bfloat16', 128, 32): BlockSizes(64, 64, 4, 3),
    (90, 'prefill', 'bfloat16', 128, 64): BlockSizes(64, 64, 4, 3),
    (90, 'prefill', 'bfloat16', 256, 16): BlockSizes(32, 32, 4, 2),
    (90, 'prefill', 'bfloat16', 256, 32): BlockSizes(64, 32, 8, 2),
    (90, 'prefill', 'bfloat16', 256, 64): BlockSizes(64, 32, 8, 2),
    (90, 'prefill', 'float32', 64, 16): BlockSizes(32, 32, 4, 1),
    (90, 'prefill', 'float32', 64, 32): BlockSizes(32, 32, 4, 1),
    (90, 'prefill', 'float32', 64, 64): BlockSizes(32, 32, 4, 1),
    (90, 'prefill', 'float32', 128, 16): BlockSizes(16, 16, 4, 1),
    (90, 'prefill', 'float32', 128, 32): BlockSizes(16, 16, 4, 1),
    (90, 'prefill', 'float32', 128, 64): BlockSizes(16, 16, 4, 1),
    (90, 'prefill', 'float32', 256, 16): BlockSizes(32, 32, 8, 1),
    (90, 'prefill', 'float32', 256, 32): BlockSizes(32, 32, 8, 1),
    (90, 'prefill', 'float32', 256, 64): BlockSizes(32, 32, 8, 1),
}
