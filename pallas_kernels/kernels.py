"""Kernels: which implementation each op of a step runs, chosen once, on the host, from the platform of the
devices the step is compiled for (not the process's default backend: a step compiled for a TPU mesh from a CPU
host takes the TPU kernels). A frozen value, so it is a static argument of the jitted steps and reaches every
module as an argument: nothing below it asks which backend it runs on.
"""

import dataclasses

import jax.numpy as jnp

from pallas_kernels.native import library
from pallas_kernels.native.ops import supports as native_supports

# Attention implementations (pallas_kernels/attention.py): "reference" (plain jnp), "native" (the C++ CPU kernel),
# "pallas" (Triton), "pallas_interpret" (the Triton kernels in Pallas interpret mode), "pallas_tpu" (Mosaic),
# "pallas_tpu_interpret" (the TPU kernel in the TPU interpreter), "jax_triton" (the Triton-language kernels through
# jax-triton, CUDA only).
ATTENTION_IMPLS = ("reference", "native", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret",
                   "jax_triton")
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True, slots=True)
class Kernels:
    platform: str    # "cpu", "gpu" or "tpu": the devices the step runs on
    attention: str   # one of ATTENTION_IMPLS
    native: bool     # the native CPU ops: RMSNorm, the KV write, the packed stacked matmul (CPU, library built)

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"unknown platform {self.platform!r}; expected one of {PLATFORMS}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {self.attention!r}; expected one of {ATTENTION_IMPLS}")
        if self.native and self.platform != "cpu":
            raise ValueError("the native kernels run on the CPU only")

    @classmethod
    def for_platform(cls, platform: str, dtype=None, kv_dtype=None, attention: str | None = None) -> "Kernels":
        """The kernels for `platform` ("cuda"/"rocm" count as "gpu"), with activations of `dtype` over a KV cache
        of `kv_dtype` (default: dtype), and `attention` forced if given (a "pallas" request on a TPU takes the
        Mosaic kernel: Triton does not run there)."""
        platform = "gpu" if platform in ("cuda", "rocm") else platform
        native = platform == "cpu" and library.available()
        if attention is None:
            attention = default_attention(platform, dtype, kv_dtype or dtype, native)
        elif attention == "pallas" and platform == "tpu":
            attention = "pallas_tpu"
        return cls(platform, attention, native)

    @classmethod
    def for_mesh(cls, mesh, dtype=None, kv_dtype=None, attention: str | None = None) -> "Kernels":
        """The kernels for the devices of `mesh` (one platform)."""
        return cls.for_platform(mesh.devices.flat[0].platform, dtype, kv_dtype, attention)


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
