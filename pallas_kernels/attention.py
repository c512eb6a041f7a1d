"""One entry point for paged attention; picks the implementation by backend.

  gpu -> Pallas kernels lowered through Triton
  tpu -> Pallas kernels (Mosaic TPU)
  cpu -> the plain-jnp reference, unless another implementation is asked for

`impl` forces one: "reference", "pallas", or "pallas_interpret" (Pallas in interpret mode,
which runs anywhere and is how the CPU tests exercise the kernels).
"""

import jax

from pallas_kernels import reference

IMPLS = ("reference", "pallas", "pallas_interpret")


def default_impl(backend: str | None = None) -> str:
    backend = backend or jax.default_backend()
    return "reference" if backend == "cpu" else "pallas"


def paged_attention(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
    *, decode: bool, scale: float, soft_cap: float | None = None, impl: str | None = None,
):
    """Decode (one query per sequence, q [S, Hq, D]) or chunked prefill (flat q [T, Hq, D])."""
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl == "reference":
        if decode:
            return reference.paged_decode_attention_ref(
                q, k_pages, v_pages, block_tables, context_lens, scale=scale, soft_cap=soft_cap)
        return reference.paged_prefill_attention_ref(
            q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
            scale=scale, soft_cap=soft_cap)
    raise NotImplementedError("Pallas kernels land with the kernels issue")
