"""Both kernels lower for CUDA through Triton, at every supported model family's attention shape.

Runs on a CPU-only host: `jax.export` for platform "cuda" (pallas_kernels/lowering.py: under an
abstract H200 device, which jax >= 0.11 asks for when the host has no GPU) lowers the Pallas
kernels to Triton IR without a GPU, and the module must carry the Triton custom call. Passes on
jax 0.10.x and 0.11.x; the Pallas-Triton backend's deprecation warning (jax 0.11) is expected.

What this proves: the Pallas -> Triton-IR lowering works (every primitive has a Triton rule,
every block is a power of two, the Triton backend -- not Mosaic GPU -- was chosen). jax 0.10.x and
0.11.x put the Triton IR into a `__gpu$xla.gpu.triton` custom call that XLA compiles to PTX on the
GPU later, so the Triton -> PTX step is not covered here (it was checked offline with the `triton`
3.9 wheel for sm_90a, where all these shapes compiled to cubin). Releases that switch Pallas to the
`triton_kernel_call_ffi` path compile to PTX while lowering; that needs the Triton compilation
handler the CUDA plugin registers, so on a host without it the test is skipped with that reason
(never passed silently), and on the GPU machine it covers PTX compilation too.
"""

import jax
import jax.numpy as jnp
import pytest

from helpers.cuda_lowering import lower_for_cuda
from pallas_kernels.attention import paged_attention
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.prefill import paged_prefill_attention

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# name: (num_q_heads, num_kv_heads, head_dim)
MODEL_SHAPES = {
    "llama2-7b": (32, 32, 128),
    "llama3-8b": (32, 8, 128),
    "mistral-7b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen3-8b": (32, 8, 128),
    "gemma-2b": (8, 1, 256),
    "gemma-7b": (16, 16, 256),
    "head_dim-80": (32, 32, 80),
    "head_dim-96": (24, 8, 96),
}
BLOCK_SIZE = 16
NUM_BLOCKS = 512
NUM_SEQS = 8
TABLE_WIDTH = 64  # 1024-token contexts
NUM_TOKENS = 256  # prefill rows


def _specs(hq, hkv, d, dtype, num_rows):
    return (
        jax.ShapeDtypeStruct((num_rows, hq, d), dtype),
        jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, hkv, d), dtype),
        jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, hkv, d), dtype),
        jax.ShapeDtypeStruct((NUM_SEQS, TABLE_WIDTH), jnp.int32),
        jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32),
        jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32),
    )


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_lowers_for_cuda(model, decode):
    hq, hkv, d = MODEL_SHAPES[model]
    soft_cap = 50.0 if model.startswith("gemma") else None  # exercise tanh on some shapes
    specs = _specs(hq, hkv, d, jnp.bfloat16, NUM_SEQS if decode else NUM_TOKENS)

    def f(q, k, v, tables, lens, qsl):
        return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=d ** -0.5,
                               soft_cap=soft_cap, impl="pallas")

    lower_for_cuda(f, specs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_split_k_decode_lowers_for_cuda(dtype):
    specs = _specs(32, 8, 128, dtype, NUM_SEQS)[:5]

    def f(q, k, v, tables, lens):
        return paged_decode_attention(q, k, v, tables, lens, scale=0.088, num_splits=4)

    lower_for_cuda(f, specs)


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_block_sizes_lower_for_cuda(block_size):
    hq, hkv, d = 32, 8, 96
    cache = jax.ShapeDtypeStruct((256, block_size, hkv, d), jnp.bfloat16)
    specs = (jax.ShapeDtypeStruct((64, hq, d), jnp.bfloat16), cache, cache,
             jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
             jax.ShapeDtypeStruct((5,), jnp.int32))
    for decode in (True, False):
        def f(q, k, v, tables, lens, qsl, decode=decode):
            q = q[:4] if decode else q
            return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=0.1,
                                   impl="pallas")
        lower_for_cuda(f, specs)


@pytest.mark.parametrize("model", ["llama3-8b", "gemma-2b", "head_dim-80"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_sliding_window_lowers_for_cuda(model, decode):
    """The window as a traced argument (a per-layer value): the decode kernel's first-key input and the prefill
    tile table's window column lower with the rest."""
    hq, hkv, d = MODEL_SHAPES[model]
    specs = (*_specs(hq, hkv, d, jnp.bfloat16, NUM_SEQS if decode else NUM_TOKENS),
             jax.ShapeDtypeStruct((), jnp.int32))

    def f(q, k, v, tables, lens, qsl, window):
        return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=d ** -0.5, soft_cap=50.0,
                               sliding_window=window, impl="pallas")

    lower_for_cuda(f, specs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sliding_window_split_k_and_tiles_lower_for_cuda(dtype):
    """Split-K decode and explicit prefill tiles under a window."""
    specs = _specs(32, 8, 128, dtype, NUM_TOKENS)
    window = jax.ShapeDtypeStruct((), jnp.int32)

    def decode(q, k, v, tables, lens, window):
        return paged_decode_attention(q[:NUM_SEQS], k, v, tables, lens, scale=0.088, num_splits=4,
                                      sliding_window=window)

    def prefill(q, k, v, tables, lens, qsl, window):
        return paged_prefill_attention(q, k, v, tables, lens, qsl, scale=0.088, block_q=4, sliding_window=window)

    lower_for_cuda(decode, (*specs[:5], window))
    lower_for_cuda(prefill, (*specs, window))


@pytest.mark.parametrize("decode,splits", [(True, 1), (True, 4), (False, None)], ids=["decode", "split-k", "prefill"])
def test_sinks_lower_for_cuda(decode, splits):
    """Attention sinks as a traced [Hq] argument (gpt-oss's shape: 64 query heads, 8 KV heads, head_dim 64),
    under a window: the kernels' sinks input (a single split, prefill) and split-K's epilogue lower."""
    hq, hkv, d = 64, 8, 64
    specs = (*_specs(hq, hkv, d, jnp.bfloat16, NUM_SEQS if decode else NUM_TOKENS),
             jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((hq,), jnp.float32))

    def f(q, k, v, tables, lens, qsl, window, sinks):
        if decode:
            return paged_decode_attention(q, k, v, tables, lens, scale=0.125, num_splits=splits,
                                          sliding_window=window, sinks=sinks)
        return paged_prefill_attention(q, k, v, tables, lens, qsl, scale=0.125, sliding_window=window, sinks=sinks)

    lower_for_cuda(f, specs)
