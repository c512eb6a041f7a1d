"""One entry point for paged attention; picks the implementation by backend.

  gpu -> Pallas kernels lowered through Triton (paged_attention.py / prefill_attention.py); on a
         jax without Pallas' Triton backend (deprecated in 0.11), the same algorithm written in
         Triton's language and called through jax_triton (jax_triton_attention.py)
  tpu -> the Mosaic TPU ragged paged-attention kernel (tpu_attention.py), also when "pallas" is
         asked for on a TPU
  cpu -> the native C++ kernel (an XLA FFI custom call, native.py) where it is built and takes
         the dtype, else the plain-jnp reference

`impl` forces one: "reference", "native", "pallas" (Triton), "pallas_interpret" (the Triton
kernels in Pallas interpret mode), "pallas_tpu" (Mosaic, TPU only), "pallas_tpu_interpret"
(the TPU kernel in the TPU interpreter) or "jax_triton" (CUDA only; needs the `triton` and
`jax-triton` packages). The interpret modes run anywhere: they are how the CPU tests exercise
the kernels (the jax_triton kernel's CPU checks run it in Triton's own interpreter on host
arrays, outside jit: jax_triton_attention.run_interpreted).

The two kernel families differ because the hardware does: the Triton kernels read K/V with
masked pointer gathers (page id -> token, head, feature); Mosaic TPU has no vector gathers, so
the TPU kernel DMAs whole pages through scalar-prefetched block tables into VMEM.
"""

import jax

from pallas_kernels import native, reference

# The Pallas kernel modules are imported where they are chosen: importing Pallas' Triton and Mosaic
# lowerings costs ~0.4 s of every CPU start-up that never uses them.

IMPLS = ("reference", "native", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret",
         "jax_triton")


def default_impl(backend: str | None = None, dtype=None, page_dtype=None) -> str:
    """The impl for `backend` (default: JAX's) with q of `dtype` over pages of `page_dtype` (default:
    q's): on CPU the native kernel where it takes the pair, else the reference."""
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "pallas_tpu"
    if backend != "cpu":
        from pallas_kernels.triton_common import pallas_triton_available
        return "pallas" if pallas_triton_available() else "jax_triton"
    if native.available() and (dtype is None or native.supports(dtype, page_dtype or dtype)):
        return "native"
    return "reference"


def paged_attention(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
    *, decode: bool, scale: float, soft_cap: float | None = None, impl: str | None = None,
):
    """Decode (one query per sequence, q [S, Hq, D]) or chunked prefill (flat q [T, Hq, D])."""
    impl = impl or default_impl(dtype=q.dtype, page_dtype=k_pages.dtype)
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    if impl == "pallas" and jax.default_backend() == "tpu":
        impl = "pallas_tpu"  # Triton does not run on a TPU
    if impl == "reference":
        if decode:
            return reference.paged_decode_attention_ref(
                q, k_pages, v_pages, block_tables, context_lens, scale=scale, soft_cap=soft_cap)
        return reference.paged_prefill_attention_ref(
            q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
            scale=scale, soft_cap=soft_cap)
    if impl in ("pallas_tpu", "pallas_tpu_interpret"):
        from pallas_kernels.tpu_attention import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu(
            q, k_pages, v_pages, block_tables, context_lens, None if decode else query_start_loc,
            decode=decode, scale=scale, soft_cap=soft_cap,
            interpret=impl == "pallas_tpu_interpret")
    if impl == "jax_triton":
        from pallas_kernels.jax_triton_attention import paged_attention_jax_triton  # needs triton
        return paged_attention_jax_triton(
            q, k_pages, v_pages, block_tables, context_lens, query_start_loc, decode=decode,
            scale=scale, soft_cap=soft_cap)
    if impl == "native":
        fn = native.paged_decode_attention_native if decode else native.paged_prefill_attention_native
        args = (block_tables, context_lens) if decode else (block_tables, context_lens, query_start_loc)
        return fn(q, k_pages, v_pages, *args, scale=scale, soft_cap=soft_cap)
    # "pallas" lowers through Triton (also when traced on a CPU host for a CUDA target, which is
    # how tests/test_cuda_lowering.py checks it); "pallas_interpret" runs the same kernels anywhere.
    interpret = impl == "pallas_interpret"
    if decode:
        from pallas_kernels.paged_attention import paged_decode_attention
        return paged_decode_attention(q, k_pages, v_pages, block_tables, context_lens,
                                      scale=scale, soft_cap=soft_cap, interpret=interpret)
    from pallas_kernels.prefill_attention import paged_prefill_attention
    return paged_prefill_attention(q, k_pages, v_pages, block_tables, context_lens,
                                   query_start_loc, scale=scale, soft_cap=soft_cap,
                                   interpret=interpret)
