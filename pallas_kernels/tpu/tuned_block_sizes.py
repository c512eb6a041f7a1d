"""Block sizes and VMEM budgets of the TPU ragged paged-attention kernel, per chip generation.

A chip is named by what jax.Device.device_kind says ("TPU v6 lite", "TPU v5 lite", "TPU v5p", "TPU7x"; lower-cased); the
generation is the first entry whose key it contains. `vmem_limit_bytes` is what Mosaic may use (scoped VMEM
defaults to 16 MiB on v5e and 32 MiB on v6e, below what long K/V blocks or MHA prefill need); `kv_block_bytes`
the bytes of K (and again of V) one K/V block copies, in whole pages (a block's keys then scale inversely with
KV heads x head_dim: Mosaic unrolls the per-head work over them, so its compile time grows with this too);
`prefill_rows` the matmul rows of a prefill query block (group x tokens). The entries follow each chip's VMEM
size; they are not yet timed on a TPU (scripts/tpu_check.py times the kernel where one is lent).
"""

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class ChipBlockSizes:
    vmem_bytes: int          # VMEM per TensorCore
    vmem_limit_bytes: int    # the kernel's scoped VMEM limit
    kv_block_bytes: int      # K bytes (and V bytes) per K/V block
    prefill_rows: int        # matmul rows (query heads of a group x tokens) per prefill query block


MiB = 1 << 20

# device_kind substring -> sizes; first match wins, so more specific keys come first.
TUNED_BLOCK_SIZES = {
    "v7": ChipBlockSizes(64 * MiB, 48 * MiB, 1 * MiB, 256),
    "tpu7": ChipBlockSizes(64 * MiB, 48 * MiB, 1 * MiB, 256),
    "v6": ChipBlockSizes(128 * MiB, 96 * MiB, 1 * MiB, 256),
    "v5 lite": ChipBlockSizes(128 * MiB, 96 * MiB, 1 * MiB, 128),
    "v5e": ChipBlockSizes(128 * MiB, 96 * MiB, 1 * MiB, 128),
    "v5": ChipBlockSizes(95 * MiB, 64 * MiB, 1 * MiB, 128),   # v5p
    "v4": ChipBlockSizes(32 * MiB, 24 * MiB, 512 * 1024, 128),
}
# An unknown chip (or the interpreter): the smallest VMEM of the table.
DEFAULT_BLOCK_SIZES = ChipBlockSizes(32 * MiB, 24 * MiB, 512 * 1024, 128)


def block_sizes_for(device_kind: str | None) -> ChipBlockSizes:
    kind = (device_kind or "").lower()
    return next((sizes for key, sizes in TUNED_BLOCK_SIZES.items() if key in kind), DEFAULT_BLOCK_SIZES)
