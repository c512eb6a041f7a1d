"""The quantized KV cache's pages (pallas_kernels/kv_quant.py: int8 / float8_e4m3fn rows, each the head's values
then its float32 scale's 4 bytes): the quantize / dequantize round trip, the row layout (checked byte for byte
against numpy, independently of kv_quant), and every attention implementation against the reference on the
same quantized pages, with random bytes (NaN and inf scales included) in every slot no sequence owns.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import make_cache, prefill_batch, random_q, random_sinks
from pallas_kernels import kv_quant, ops
from pallas_kernels.attention import paged_attention, write_kv_and_attend
from pallas_kernels.kernels import Kernels
from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

QUANTIZED = [jnp.int8, jnp.float8_e4m3fn]
# Every implementation: the jax-triton kernel in Triton's interpreter (on host copies: tests only)
IMPLS = ["native", "pallas_interpret", "pallas_tpu_interpret", "jax_triton_interpret"]


def _attend(impl, q, k, v, tables, lens, qsl, *, decode, scale, **options):
    """`impl` on these arrays; options: soft_cap, sliding_window, sinks."""
    if impl == "jax_triton_interpret":
        from pallas_kernels.triton.jax_triton import run_interpreted  # noqa: PLC0415 (needs triton)
        return run_interpreted(q, k, v, tables, lens, qsl, decode=decode, scale=scale, **options)
    return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=scale, impl=impl, **options)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _rows(rng, shape):
    """Rows of very different magnitudes (so each needs its own scale), one of them all zeros."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, size=(*shape[:-1], 1))
    x[(0,) * (len(shape) - 1)] = 0.0
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=lambda d: jnp.dtype(d).name)
def test_round_trip_error_bound(seed, dtype):
    """int8: |dequantize(quantize(x)) - x| <= scale / 2 per element, the row's largest |x| exactly +-127 steps;
    float8_e4m3fn: within half a unit in the last place (2^-4 relative, 2^-10 scale below the normals). A zero
    row comes back as exact zeros."""
    x = _rows(np.random.default_rng(seed), (6, 3, 40))
    rows = kv_quant.quantize(x, dtype)
    assert rows.dtype == jnp.dtype(dtype) and rows.shape == (6, 3, 44)
    back = np.asarray(kv_quant.dequantize(rows))
    values, scale = (np.asarray(a, np.float32) for a in kv_quant.split(rows))
    x = np.asarray(x)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / kv_quant.QMAX[jnp.dtype(dtype)], 1.0), rtol=1e-6)
    err = np.abs(back - x)
    if dtype == jnp.int8:
        bound = scale / 2 * (1 + 1e-5)
        assert np.all(np.abs(values).max(axis=-1)[amax[..., 0] > 0] == 127), f"seed={seed}"
    else:
        bound = np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert np.all(err <= bound), f"max err / bound {np.max(err / bound):.3g} seed={seed}"
    assert np.all(back[0, 0] == 0) and scale[0, 0, 0] == 1.0


@pytest.mark.parametrize("dtype", QUANTIZED, ids=lambda d: jnp.dtype(d).name)
def test_row_layout_is_values_then_little_endian_float32_scale(dtype):
    """The layout every kernel reads, checked against numpy's own bytes: D values, then the scale as '<f4'."""
    x = jnp.asarray([[0.5, -1.0, 2.0, 0.25], [3.0, 0.0, -6.0, 1.5]], jnp.float32)
    rows = np.asarray(jax.lax.bitcast_convert_type(kv_quant.quantize(x, dtype), jnp.uint8))
    qmax = kv_quant.QMAX[jnp.dtype(dtype)]
    for row, amax in zip(rows, (2.0, 6.0)):
        # read back as little-endian float32 by numpy (XLA may divide by qmax as a multiply: one ulp off)
        np.testing.assert_allclose(np.frombuffer(row[4:].tobytes(), "<f4")[0], amax / qmax, rtol=1e-6)
    if dtype == jnp.int8:
        np.testing.assert_array_equal(rows[:, :4].view(np.int8), [[32, -64, 127, 16], [64, 0, -127, 32]])


def _handmade_int8_pages(rng, num_blocks, block_size, heads, dim):
    """int8 pages built with numpy alone (the scale's bytes by '<f4'), and their float values."""
    values = rng.integers(-127, 128, size=(num_blocks, block_size, heads, dim), dtype=np.int8)
    scale = rng.uniform(0.01, 2.0, size=(num_blocks, block_size, heads, 1)).astype("<f4")
    pages = np.concatenate([values, scale.view(np.int8)], axis=-1)
    return jnp.asarray(pages), jnp.asarray(values.astype(np.float32) * scale)


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_implementations_read_handmade_int8_pages(seed, impl, request):
    """Each implementation over int8 pages made by hand equals the float reference over their values * scale:
    a kernel that read the scale's bytes in another order, or from another place, fails this."""
    if impl == "native":
        request.getfixturevalue("native_library")
    if impl == "jax_triton_interpret":
        pytest.importorskip("triton")
        pytest.importorskip("torch", reason="Triton's interpreter reads buffers through torch")
    rng = np.random.default_rng(seed)
    k, k_float = _handmade_int8_pages(rng, 6, 8, 2, 16)
    v, v_float = _handmade_int8_pages(rng, 6, 8, 2, 16)
    tables = jnp.asarray([[3, 1, 5], [2, 4, 0]], jnp.int32)
    lens = jnp.asarray([21, 9], jnp.int32)
    q = random_q(rng, 2, 4, 16, jnp.float32, magnitude=0.3)
    want = paged_decode_attention_ref(q, k_float, v_float, tables, lens, scale=0.25)
    got = _attend(impl, q, k, v, tables, lens, None, decode=True, scale=0.25)
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"seed={seed}")


def _quantized_cache(rng, context_lens, *, block_size, num_kv_heads, head_dim, dtype):
    """make_cache's pages quantized; every slot no sequence owns (NaN there) holds random bytes instead."""
    k, v, tables = make_cache(rng, context_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=jnp.float32)
    out = []
    for pages in (k, v):
        unused = np.isnan(np.asarray(pages)).any(axis=-1, keepdims=True)
        rows = np.asarray(jax.lax.bitcast_convert_type(kv_quant.quantize(jnp.nan_to_num(pages), dtype), jnp.uint8))
        garbage = rng.integers(0, 256, size=rows.shape, dtype=np.uint8)
        garbage[..., -4:] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # a NaN scale
        garbage[::2, ..., -4:] = rng.integers(0, 256, size=garbage[::2, ..., -4:].shape)
        rows = np.where(unused, garbage, rows)
        out.append(jax.lax.bitcast_convert_type(jnp.asarray(rows), dtype))
    return out[0], out[1], tables


CASES = [  # (num_q_heads, num_kv_heads, head_dim, block_size)
    (4, 2, 64, 8),
    (8, 1, 32, 16),
    (6, 3, 80, 8),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_match_reference_on_quantized_pages(seed, impl, kv_dtype, q_dtype, case, request):
    """Decode, and chunked prefill over the shared batch (prefix hits, page-crossing chunks, an empty chunk,
    padding rows), of each implementation against the reference on the same quantized pages."""
    if impl == "native":
        request.getfixturevalue("native_library")
    if impl == "jax_triton_interpret":
        pytest.importorskip("triton")
        pytest.importorskip("torch", reason="Triton's interpreter reads buffers through torch")
    num_q_heads, num_kv_heads, head_dim, block_size = CASES[case]
    rng = np.random.default_rng(seed)
    scale = head_dim ** -0.5
    # decode
    lens = [1, block_size, 3 * block_size + 5, 40]
    k, v, tables = _quantized_cache(rng, lens, block_size=block_size, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, dtype=kv_dtype)
    q = random_q(rng, len(lens), num_q_heads, head_dim, q_dtype)
    lens = jnp.asarray(lens, jnp.int32)
    want = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale)
    got = _attend(impl, q, k, v, tables, lens, None, decode=True, scale=scale)
    _check(got, want, q_dtype, f"{impl} decode seed={seed}")
    # prefill
    batch = prefill_batch(block_size)
    ctx = [p + c for p, c in batch]
    k, v, tables = _quantized_cache(rng, ctx, block_size=block_size, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, dtype=kv_dtype)
    chunks = [c for _, c in batch]
    q = random_q(rng, sum(chunks) + 3, num_q_heads, head_dim, q_dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    lens = jnp.asarray(ctx, jnp.int32)
    want = paged_prefill_attention_ref(q, k, v, tables, lens, qsl, scale=scale)
    got = _attend(impl, q, k, v, tables, lens, qsl, decode=False, scale=scale)
    _check(got, want, q_dtype, f"{impl} prefill seed={seed}")
    assert np.all(np.asarray(got[-3:], np.float32) == 0), f"padding rows not zero seed={seed}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [0, 5], ids=["no-window", "window"])
def test_sinks_on_int8_pages(seed, impl, window, request):
    """Attention sinks (+10, +5, -4 and random ones) over int8 pages, bfloat16 q with a soft cap, decode and
    chunked prefill, with and without a sliding window: each implementation against the reference on the same
    pages."""
    if impl == "native":
        request.getfixturevalue("native_library")
    if impl == "jax_triton_interpret":
        pytest.importorskip("triton")
        pytest.importorskip("torch", reason="Triton's interpreter reads buffers through torch")
    num_q_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 8
    rng = np.random.default_rng(seed)
    options = dict(soft_cap=20.0, sinks=random_sinks(rng, num_q_heads))
    kernel_window = dict(sliding_window=jnp.int32(window))
    scale = head_dim ** -0.5
    lens = [1, block_size, 3 * block_size + 5, 40]
    k, v, tables = _quantized_cache(rng, lens, block_size=block_size, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, dtype=jnp.int8)
    q = random_q(rng, len(lens), num_q_heads, head_dim, jnp.bfloat16)
    lens = jnp.asarray(lens, jnp.int32)
    want = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale, sliding_window=window or None, **options)
    got = _attend(impl, q, k, v, tables, lens, None, decode=True, scale=scale, **kernel_window, **options)
    _check(got, want, jnp.bfloat16, f"{impl} decode sinks seed={seed}")
    batch = prefill_batch(block_size)
    ctx = [p + c for p, c in batch]
    k, v, tables = _quantized_cache(rng, ctx, block_size=block_size, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, dtype=jnp.int8)
    chunks = [c for _, c in batch]
    q = random_q(rng, sum(chunks) + 3, num_q_heads, head_dim, jnp.bfloat16)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    lens = jnp.asarray(ctx, jnp.int32)
    want = paged_prefill_attention_ref(q, k, v, tables, lens, qsl, scale=scale, sliding_window=window or None,
                                       **options)
    got = _attend(impl, q, k, v, tables, lens, qsl, decode=False, scale=scale, **kernel_window, **options)
    _check(got, want, jnp.bfloat16, f"{impl} prefill sinks seed={seed}")
    assert np.all(np.asarray(got[-3:], np.float32) == 0), f"padding rows not zero seed={seed}"


def _check(got, want, dtype, what):
    assert got.dtype == want.dtype == jnp.dtype(dtype), what
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(want).all() and np.isfinite(got).all(), what
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=lambda d: jnp.dtype(d).name)
def test_writes_quantize_alike(seed, kv_dtype, native_library):
    """ops.write_kv through the native row write and through jnp leave the same bytes: each written row
    quantize(k) with its scale, the rest untouched; the TPU kernel's fused write too (its padded pages)."""
    rng = np.random.default_rng(seed)
    num_blocks, block_size, heads, dim = 5, 4, 2, 16
    shape = (num_blocks, block_size, heads, dim + 4)
    start = jnp.asarray(rng.integers(-100, 100, size=shape), jnp.int8)
    start = jax.lax.bitcast_convert_type(start, kv_dtype)
    k = jnp.asarray(rng.standard_normal((3, heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, heads, dim)), jnp.float32) * 100
    slots = jnp.asarray([5, 17, 2], jnp.int32)
    outs = []
    for kernels in (Kernels("cpu", "native", True), Kernels("cpu", "reference", False)):
        outs.append(jax.jit(ops.write_kv, static_argnums=5)(start, start, k, v, slots, kernels))
    bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))  # noqa: E731
    for side in (0, 1):
        np.testing.assert_array_equal(bits(outs[0][side]), bits(outs[1][side]))
    want = bits(start).reshape(-1, heads, dim + 4).copy()
    want[np.asarray(slots)] = bits(kv_quant.quantize(v, kv_dtype))
    np.testing.assert_array_equal(bits(outs[0][1]).reshape(want.shape), want)

    # The TPU kernel's fused write, into pages padded as the engine stores them (Kernels.kv_page_dims).
    tpu = Kernels("cpu", "pallas_tpu_interpret", False)
    page_heads, page_dim = tpu.kv_page_dims(heads, dim, kv_dtype)
    padded = jnp.zeros((num_blocks, block_size, page_heads, page_dim), kv_dtype)
    padded = padded.at[:, :, :heads, :dim + 4].set(start)
    q = random_q(rng, 3, 4, dim, jnp.float32)
    tables = jnp.asarray([[1, 3], [4, 2], [0, 0]], jnp.int32)
    lens = jnp.asarray([2, 2, 3], jnp.int32)
    qsl = jnp.asarray([0, 1, 2, 3], jnp.int32)
    _, k_pages, v_pages = write_kv_and_attend(q, k, v, padded, jnp.array(padded), slots, tables, lens, qsl,
                                              decode=False, scale=0.25, kernels=tpu)
    for side, pages in enumerate((k_pages, v_pages)):
        np.testing.assert_array_equal(bits(pages[:, :, :heads, :dim + 4]), bits(outs[0][side]))
        assert not bits(pages[:, :, heads:]).any() and not bits(pages[..., dim + 4:]).any()


def test_kv_page_dims_hold_the_scale():
    """Quantized pages' rows are head_dim + 4 (the scale) everywhere; the TPU's pad that to lane tiles and the
    heads to 4 (8-bit sublane packing)."""
    assert Kernels("cpu", "reference", False).kv_page_dims(2, 64, jnp.int8) == (2, 68)
    assert Kernels("cpu", "reference", False).kv_page_dims(2, 64, jnp.bfloat16) == (2, 64)
    assert Kernels("tpu", "pallas_tpu", False).kv_page_dims(2, 64, jnp.float8_e4m3fn) == (4, 128)
    assert Kernels("tpu", "pallas_tpu", False).kv_page_dims(2, 128, jnp.int8) == (4, 256)


@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_quantized_pallas_kernels_lower_for_cuda(kv_dtype):
    """The Pallas-Triton kernels over quantized pages lower for CUDA on this CPU host (test_cuda_lowering.py's
    check: every primitive of the scale's byte gather has a Triton rule)."""
    from helpers.cuda_lowering import lower_for_cuda  # noqa: PLC0415

    hq, hkv, d = 32, 8, 128
    pages = jax.ShapeDtypeStruct((256, 16, hkv, d + 4), kv_dtype)
    for decode, rows in ((True, 8), (False, 128)):
        specs = (jax.ShapeDtypeStruct((rows, hq, d), jnp.bfloat16), pages, pages,
                 jax.ShapeDtypeStruct((8, 32), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32),
                 jax.ShapeDtypeStruct((9,), jnp.int32))

        def f(q, k, v, tables, lens, qsl, decode=decode):
            return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=d ** -0.5, impl="pallas")

        lower_for_cuda(f, specs)
