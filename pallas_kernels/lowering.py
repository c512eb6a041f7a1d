"""Lowering a kernel for an accelerator this host does not have (CUDA or TPU from a CPU host).

Used by the lowering tests (tests/pallas_kernels/test_cuda_lowering.py,
                            tests/pallas_kernels/test_tpu_kernel.py) and the device
check scripts' --smoke paths. `export_for(platform, f, specs)` runs jax.export for that platform and
returns the StableHLO text:

  * jax >= 0.11 asks which device a GPU/TPU kernel targets when the host has none ("please specify
    an abstract GPU device"): the export runs under an abstract mesh that declares one
    (jax.sharding.AbstractDevice; 0.10.x has the API too and lowers the same under it);
  * the Pallas-Triton custom call has no export compatibility guarantee, so its safety check is
    disabled (tpu_custom_call is on jax's stable list and needs nothing).
"""

import contextlib
from dataclasses import dataclass

import jax

TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")
TPU_CALL_TARGET = "tpu_custom_call"


@dataclass(frozen=True, slots=True)
class Target:
    platform: str     # jax.export platform name: "cuda" or "tpu"
    device_kind: str  # what jax.Device.device_kind says on that hardware
    num_cores: int    # SMs (GPU) or TensorCores per chip (TPU)


# The attention head shapes the lowering checks cover (tests, scripts/kernel_tables.py):
# name: (num_q_heads, num_kv_heads, head_dim)
MODEL_HEAD_SHAPES = {
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "gemma-2b": (8, 1, 256),
    "head_dim-64": (14, 2, 64),
    "head_dim-80": (32, 32, 80),
    "head_dim-96": (24, 8, 96),
}

# Default targets: the GPU the team borrows, and a current TPU generation.
TARGETS = {
    "cuda": Target("cuda", "NVIDIA H200", 132),
    "tpu": Target("tpu", "TPU v6 lite", 1),
}


@contextlib.contextmanager
def abstract_device(target: Target):
    """Declare `target` as the device being compiled for, unless this host has that platform."""
    host_platforms = {d.platform for d in jax.devices()}
    wanted = "gpu" if target.platform in ("cuda", "rocm") else target.platform
    device_cls = getattr(jax.sharding, "AbstractDevice", None)
    if wanted in host_platforms or device_cls is None:
        yield
        return
    device = device_cls(target.device_kind, target.num_cores, target.platform)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def export_for(platform: str, f, specs, *, target: Target | None = None) -> str:
    """StableHLO text of jax.export(jax.jit(f), platforms=[platform]) on argument specs `specs`."""
    target = target or TARGETS[platform]
    disabled = [jax.export.DisabledSafetyCheck.custom_call(name) for name in TRITON_CALL_TARGETS]
    with abstract_device(target):
        exported = jax.export.export(jax.jit(f), platforms=[platform],
                                     disabled_checks=disabled)(*specs)
    return exported.mlir_module()
