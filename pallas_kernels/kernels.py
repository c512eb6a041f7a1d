"""Kernels: which implementation each op of a step runs, chosen once, on the host, from the platform of the
devices the step is compiled for (not the process's default backend: a step compiled for a TPU mesh from a CPU
host takes the TPU kernels). A frozen value, so it is a static argument of the jitted steps and reaches every
module as an argument: nothing below it asks which backend it runs on.
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels.kv_quant import page_dim
from pallas_kernels.native import library
from pallas_kernels.native.ops import supports as native_supports
from pallas_kernels.tpu.layout import page_head_dim, page_kv_heads

# Attention implementations (pallas_kernels/attention.py): "reference" (plain jnp), "native" (the C++ CPU kernel),
# "pallas" (Triton), "pallas_interpret" (the Triton kernels in Pallas interpret mode), "pallas_tpu" (Mosaic),
# "pallas_tpu_interpret" (the TPU kernel in the TPU interpreter), "jax_triton" (the Triton-language kernels through
# jax-triton, CUDA only).
ATTENTION_IMPLS = ("reference", "native", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret",
                   "jax_triton")
TPU_IMPLS = ("pallas_tpu", "pallas_tpu_interpret")  # the TPU kernel: pages padded to lane tiles, K/V written by it
PLATFORMS = ("cpu", "gpu", "tpu")
@dataclasses.dataclass(frozen=True, slots=True)
class Kernels:
    platform: str    # "cpu", "gpu" or "tpu": the devices the step runs on
    attention: str   # one of ATTENTION_IMPLS
    native: bool     # the native CPU ops: RMSNorm, the KV write, the packed stacked matmul (CPU, library built)
    device_kind: str = ""  # the chip (jax.Device.device_kind): the TPU kernel's block sizes follow it

    def kv_page_dims(self, num_kv_heads: int, head_dim: int, dtype, shards: int = 1) -> tuple[int, int]:
        """(KV heads, head dim) of the KV cache's pages, over `shards` tensor-parallel shards. For the TPU kernel,
        padded (zeros in the padding): head_dim to whole 128-lane tiles, which its DMAs move, and each shard's
        heads to the dtype's sublane packing (2 for 16-bit types: XLA lays out an odd count of 16-bit heads
        unpacked, and the kernel's custom call would copy the whole pool to repack it). Elsewhere the model's.
        A quantized dtype (int8, float8_e4m3fn) adds the row's float32 scale, 4 bytes after the values
        (pallas_kernels/kv_quant.py), before the TPU's padding."""
        dim = page_dim(head_dim, dtype)
        if self.attention not in TPU_IMPLS:
            return num_kv_heads, dim
        return shards * page_kv_heads(num_kv_heads // shards, dtype), page_head_dim(dim)

    def check_step_limits(self, num_seqs: int, table_width: int, num_tokens: int) -> None:
        """Raise a ValueError naming the flags to change where a step of these shapes cannot run (the TPU
        kernel's block tables must fit SMEM)."""
        if self.attention in TPU_IMPLS:
            from pallas_kernels.tpu.ragged_paged_attention import check_smem  # noqa: PLC0415 (imports Pallas)
            check_smem(num_seqs, table_width, num_tokens)

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"unknown platform {self.platform!r}; expected one of {PLATFORMS}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {self.attention!r}; expected one of {ATTENTION_IMPLS}")
        if self.native and self.platform != "cpu":
            raise ValueError("the native kernels run on the CPU only")

    @classmethod
    def for_platform(cls, platform: str, dtype=None, kv_dtype=None, attention: str | None = None,
                     device_kind: str = "") -> "Kernels":
        """The kernels for `platform` ("cuda"/"rocm" count as "gpu"), with activations of `dtype` over a KV cache
        of `kv_dtype` (default: dtype), and `attention` forced if given (a "pallas" request on a TPU takes the
        Mosaic kernel: Triton does not run there)."""
        platform = "gpu" if platform in ("cuda", "rocm") else platform
        native = platform == "cpu" and library.available()
        if attention is None:
            attention = default_attention(platform, dtype, kv_dtype or dtype, native)
        elif attention == "pallas" and platform == "tpu":
            attention = "pallas_tpu"
        return cls(platform, attention, native, device_kind)

    @classmethod
    def for_mesh(cls, mesh, dtype=None, kv_dtype=None, attention: str | None = None) -> "Kernels":
        """The kernels for the devices of `mesh` (one platform)."""
        device = mesh.devices.flat[0]
        return cls.for_platform(device.platform, dtype, kv_dtype, attention, device.device_kind)


def default_attention(platform: str, dtype=None, kv_dtype=None, native: bool | None = None) -> str:
    """The attention impl for `platform` with q of `dtype` over pages of `kv_dtype`: the Mosaic kernel on a TPU,
    Triton on a GPU (through jax-triton where jax has no Pallas-Triton backend), and on the CPU the native kernel
    where it is built and takes the dtype pair, else the reference."""
    if platform == "tpu":
        return "pallas_tpu"
    if platform in ("gpu", "cuda", "rocm"):
        from pallas_kernels.triton.common import pallas_triton_available  # noqa: PLC0415 (imports Pallas)
        return "pallas" if pallas_triton_available() else "jax_triton"
    native = library.available() if native is None else native
    if native and (dtype is None or native_supports(jnp.dtype(dtype), jnp.dtype(kv_dtype or dtype))):
        return "native"
    return "reference"
