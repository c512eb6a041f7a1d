"""The jax_triton.triton_call glue of the Triton-language kernel, traced on a CPU host.

jax-triton 0.4 needs Python >= 3.12 and jax >= 0.11, so this runs in the jax 0.11 environment
(`make test-jax011`); in the main environment (Python 3.11, where only jax-triton 0.3 installs and
it refuses to import without a GPU jaxlib) it skips by that reason. Tracing checks what a GPU run
would get: one triton_kernel_call per step with the kernel's argument order, the launch grid and
constexprs, and the output's shape and dtype. Lowering it needs the CUDA plugin's Triton extension
(jaxlib.gpu_triton), so that part is scripts/gpu_check.py's, on a GPU.
"""

import jax
import jax.numpy as jnp
import pytest

jax_triton = pytest.importorskip(
    "jax_triton", reason="jax-triton 0.4 (Python >= 3.12, jax >= 0.11) is not importable here",
    exc_type=ImportError)

from pallas_kernels.attention import paged_attention  # noqa: E402
from pallas_kernels.triton.jax_triton import plan_launch  # noqa: E402

NUM_SEQS, NUM_TOKENS, TABLE_WIDTH = 8, 64, 16


def _specs(hq, hkv, d, rows):
    cache = jax.ShapeDtypeStruct((32, 16, hkv, d), jnp.bfloat16)
    return (jax.ShapeDtypeStruct((rows, hq, d), jnp.bfloat16), cache, cache,
            jax.ShapeDtypeStruct((NUM_SEQS, TABLE_WIDTH), jnp.int32),
            jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32),
            jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32))


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (8, 1, 256), (28, 4, 80)])
def test_dispatch_traces_one_triton_kernel_call(decode, hq, hkv, d):
    rows = NUM_SEQS if decode else NUM_TOKENS
    specs = _specs(hq, hkv, d, rows)

    def f(q, k, v, tables, lens, qsl):
        return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=d ** -0.5,
                               soft_cap=30.0, impl="jax_triton")

    jaxpr = jax.make_jaxpr(f)(*specs)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "triton_kernel_call"]
    assert len(calls) == 1, jaxpr
    (call,) = calls
    # tiles, q, k, v, block tables: the kernel's pointer arguments before the output.
    in_shapes = [tuple(v.aval.shape) for v in call.invars]
    assert in_shapes[1:] == [(rows, hq, d), (32, 16, hkv, d), (32, 16, hkv, d),
                             (NUM_SEQS, TABLE_WIDTH)], in_shapes
    launch = plan_launch((rows, hq, d), (32, 16, hkv, d), jnp.bfloat16, num_seqs=NUM_SEQS,
                         table_width=TABLE_WIDTH, decode=decode, scale=d ** -0.5, soft_cap=30.0,
                         num_splits=None)  # as the dispatch: split-K where the SMs would idle
    assert in_shapes[0] == (launch.num_tiles, 5)
    assert tuple(call.params["grid"]) == launch.grid
    assert dict(call.params["metaparams"]) == launch.constexprs
    (out,) = jaxpr.out_avals
    assert out.shape == (rows, hq, d) and out.dtype == jnp.bfloat16


def test_split_k_decode_traces_one_call_and_its_combine():
    """Few sequences over long tables: one split-K call (a grid axis of splits, three float32 partial outputs),
    combined into q's shape and dtype."""
    hq, hkv, d, width = 32, 8, 128, 256
    cache = jax.ShapeDtypeStruct((512, 16, hkv, d), jnp.bfloat16)
    specs = (jax.ShapeDtypeStruct((NUM_SEQS, hq, d), jnp.bfloat16), cache, cache,
             jax.ShapeDtypeStruct((NUM_SEQS, width), jnp.int32), jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32))

    def f(q, k, v, tables, lens):
        return paged_attention(q, k, v, tables, lens, None, decode=True, scale=d ** -0.5, impl="jax_triton")

    jaxpr = jax.make_jaxpr(f)(*specs)
    (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "triton_kernel_call"]
    launch = plan_launch((NUM_SEQS, hq, d), (512, 16, hkv, d), jnp.bfloat16, num_seqs=NUM_SEQS, table_width=width,
                         decode=True, scale=d ** -0.5, soft_cap=None, num_splits=None)
    assert launch.num_splits > 1 and tuple(call.params["grid"]) == launch.grid == (NUM_SEQS, hkv, launch.num_splits)
    assert [tuple(v.aval.shape) for v in call.outvars] == [
        (NUM_SEQS, hq, launch.num_splits, d), (NUM_SEQS, hq, launch.num_splits), (NUM_SEQS, hq, launch.num_splits)]
    (out,) = jaxpr.out_avals
    assert out.shape == (NUM_SEQS, hq, d) and out.dtype == jnp.bfloat16
