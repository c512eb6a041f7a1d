"""Paged attention: one entry point, the implementation named by the step's Kernels (pallas_kernels/kernels.py).

  "pallas_tpu"        the Mosaic TPU ragged paged-attention kernel (tpu/ragged_paged_attention.py)
  "pallas"            Pallas kernels lowered through Triton (triton/decode.py, triton/prefill.py), GPUs
  "jax_triton"        the same algorithm in Triton's language, called through jax-triton (triton/jax_triton.py):
                      GPUs whose jax has no Pallas-Triton backend (deprecated in 0.11); needs `triton`, `jax-triton`
  "native"            the native C++ kernel, an XLA FFI custom call (native/ops.py), CPUs
  "reference"         plain jnp (reference.py): the oracle every kernel is tested against
  "pallas_interpret", "pallas_tpu_interpret"  the Triton and TPU kernels in their interpreters, anywhere: how the
                      CPU tests exercise them (the jax-triton kernel's CPU checks run it in Triton's own
                      interpreter on host arrays, outside jit: triton/jax_triton.run_interpreted)

The kernel families differ because the hardware does: the Triton kernels read K/V with masked pointer gathers
(page id -> token, head, feature); Mosaic TPU has no vector gathers, so the TPU kernel DMAs whole pages through
scalar-prefetched block tables into VMEM. The Pallas kernel modules are imported where they are chosen: importing
Pallas' Triton and Mosaic lowerings costs a CPU start-up that never uses them.
"""

from pallas_kernels import ops, reference
from pallas_kernels.kernels import ATTENTION_IMPLS, TPU_IMPLS, Kernels
from pallas_kernels.native import ops as native


def write_kv_and_attend(q, k, v, k_pages, v_pages, slot_mapping, block_tables, context_lens, query_start_loc, *,
                        decode: bool, scale: float, kernels: Kernels, soft_cap: float | None = None,
                        sliding_window=None, sinks=None):
    """A layer's attention step: this step's K/V rows k, v [T, Hkv, D] into their slots, then paged attention over
    the pages -> (out, k_pages, v_pages). The TPU kernel does both in one call, the pages aliased (no scatter per
    layer); elsewhere the write is ops.write_kv and the attention `paged_attention`. `sliding_window`: None, or
    this layer's window as an int32 scalar (0: none; reference.py says what it masks). `sinks`: None, or this
    layer's attention sinks (gpt-oss), float32 [Hq] of the query heads q holds (under tensor parallelism, the
    shard's); reference.py says what they do."""
    if kernels.attention in TPU_IMPLS:
        from pallas_kernels.tpu.ragged_paged_attention import write_kv_and_attend_tpu  # noqa: PLC0415
        return write_kv_and_attend_tpu(
            q, k, v, k_pages, v_pages, slot_mapping, block_tables, context_lens, None if decode else query_start_loc,
            decode=decode, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks,
            device_kind=kernels.device_kind or None, interpret=kernels.attention == "pallas_tpu_interpret")
    k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, slot_mapping, kernels)
    out = paged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, decode=decode,
                          scale=scale, impl=kernels.attention, soft_cap=soft_cap, sliding_window=sliding_window,
                          sinks=sinks, device_kind=kernels.device_kind)
    return out, k_pages, v_pages


def paged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, decode: bool, scale: float,
                    impl: str, soft_cap: float | None = None, sliding_window=None, sinks=None,
                    device_kind: str = ""):
    """Decode (one query per sequence, q [S, Hq, D]) or chunked prefill (flat q [T, Hq, D]) through `impl`.
    soft_cap, sliding_window and sinks (None, or float32 [Hq]) as in reference.py; `device_kind`: the chip
    compiled for (the TPU kernel's block sizes follow it)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    if impl == "reference":
        if decode:
            return reference.paged_decode_attention_ref(
                q, k_pages, v_pages, block_tables, context_lens, scale=scale, soft_cap=soft_cap,
                sliding_window=sliding_window, sinks=sinks)
        return reference.paged_prefill_attention_ref(
            q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks)
    if impl in TPU_IMPLS:
        from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu  # noqa: PLC0415
        return ragged_paged_attention_tpu(
            q, k_pages, v_pages, block_tables, context_lens, None if decode else query_start_loc,
            decode=decode, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks,
            device_kind=device_kind or None, interpret=impl == "pallas_tpu_interpret")
    if impl == "jax_triton":
        from pallas_kernels.triton.jax_triton import paged_attention_jax_triton  # noqa: PLC0415 (needs triton)
        return paged_attention_jax_triton(
            q, k_pages, v_pages, block_tables, context_lens, query_start_loc, decode=decode,
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, sinks=sinks)
    if impl == "native":
        if decode:
            return native.paged_decode_attention_native(q, k_pages, v_pages, block_tables, context_lens,
                                                        scale=scale, soft_cap=soft_cap,
                                                        sliding_window=sliding_window, sinks=sinks)
        return native.paged_prefill_attention_native(q, k_pages, v_pages, block_tables, context_lens,
                                                     query_start_loc, scale=scale, soft_cap=soft_cap,
                                                     sliding_window=sliding_window, sinks=sinks)
    # "pallas" lowers through Triton (also when traced on a CPU host for a CUDA target, which is
    # how tests/pallas_kernels/test_cuda_lowering.py checks it); "pallas_interpret" runs the same kernels anywhere.
    interpret = impl == "pallas_interpret"
    if decode:
        from pallas_kernels.triton.decode import paged_decode_attention  # noqa: PLC0415
        return paged_decode_attention(q, k_pages, v_pages, block_tables, context_lens,
                                      scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                                      sinks=sinks, interpret=interpret)
    from pallas_kernels.triton.prefill import paged_prefill_attention  # noqa: PLC0415
    return paged_prefill_attention(q, k_pages, v_pages, block_tables, context_lens,
                                   query_start_loc, scale=scale, soft_cap=soft_cap,
                                   sliding_window=sliding_window, sinks=sinks, interpret=interpret)


def write_latent_and_attend(q, latent, pages, slot_mapping, block_tables, context_lens, query_start_loc, *,
                            decode: bool, scale: float, kernels: Kernels, sliding_window=None):
    """Multi-head latent attention's step (models/mla.py): this step's latent rows [T, 1, D] into their slots of
    the one page array, then q [T, Hq, D] attends with those pages as both keys and values (out [T, Hq, D], of
    which the caller keeps the value part) -> (out, pages)."""
    pages = ops.write_pages(pages, latent, slot_mapping, kernels)
    if kernels.attention in TPU_IMPLS:  # its pages' heads are padded (kv_page_dims): say how many are real
        from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu  # noqa: PLC0415
        out = ragged_paged_attention_tpu(
            q, pages, pages, block_tables, context_lens, None if decode else query_start_loc, decode=decode,
            scale=scale, sliding_window=sliding_window, device_kind=kernels.device_kind or None,
            interpret=kernels.attention == "pallas_tpu_interpret", num_kv_heads=latent.shape[1])
    else:
        out = paged_attention(q, pages, pages, block_tables, context_lens, query_start_loc, decode=decode,
                              scale=scale, impl=kernels.attention, sliding_window=sliding_window,
                              device_kind=kernels.device_kind)
    return out, pages
