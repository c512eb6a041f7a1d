"""Lowering a kernel for CUDA on this CPU host, as the GPU tests do (pallas_kernels/lowering.export_for)."""

import pytest

from pallas_kernels.lowering import TRITON_CALL_TARGETS, export_for


def lower_for_cuda(f, specs) -> str:
    """The StableHLO text of f on `specs` lowered for CUDA, which must carry a Triton call and no Mosaic GPU one.
    Releases that compile Triton to PTX while lowering need the CUDA plugin's compilation handler: without it the
    test is skipped with that reason (never passed silently)."""
    try:
        text = export_for("cuda", f, specs)
    except RuntimeError as e:
        if "does not have a Triton compilation handler" in str(e):
            pytest.skip(f"this jaxlib compiles Triton to PTX while lowering and no CUDA Triton "
                        f"compilation handler is registered (no CUDA plugin here): {e}")
        raise
    assert any(call in text for call in TRITON_CALL_TARGETS), \
        f"no Triton custom call in the CUDA lowering:\n{text[:2000]}"
    assert "mosaic_gpu" not in text, "lowered through Mosaic GPU, not Triton"
    return text
