"""The native stacked matmul over packed quantized weights (int8, int4, uint4 with per-group float32 scales and
optional offsets: models.quantization.QuantizedWeight) against the float32 packed path on the dequantized weights,
bit for bit: each weight is dequantized as float(q) * s, rounded, then + o, and summed as the float32 tiles sum,
so a quantized file served packed gives the dequantized file's logits exactly. Like the other native tests, these
FAIL, never skip, without the library."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import run_poisoned
from models.quantization import QuantizedWeight
from pallas_kernels.native import library
from pallas_kernels.native import ops as native
from pallas_kernels.ops import gated_activation

pytestmark = pytest.mark.usefixtures("native_library")

KINDS = {"int8": (jnp.int8, -128, 128), "int4": (jnp.int4, -8, 8), "uint4": (jnp.uint4, 0, 16)}

# (M, K, N, groups, group size; None: one group, per output channel): SmolLM2's K = 576 in groups and as one,
# odd K (a 4-bit panel's last pair half empty), N off whole panels, two parts padded apart, every tile height
# (1-6 rows, 13 in blocks), groups of 16/32/64/128 and K.
SHAPES = [(1, 576, 200, 1, 32), (1, 576, 130, 2, None), (3, 577, 70, 1, None), (2, 64, 1100, 1, 16),
          (5, 256, 96, 2, 128), (6, 128, 33, 1, 64), (13, 96, 130, 2, 32), (4, 1, 17, 1, None)]


def quantized_stack(rng, kind, num_layers, k, n, group, offsets):
    """A random QuantizedWeight [L, K, N]: values over the kind's whole range, scales of several magnitudes,
    offsets (or none) of either sign."""
    dtype, lo, hi = KINDS[kind]
    k_groups = 1 if group is None else k // group
    values = jnp.asarray(rng.integers(lo, hi, (num_layers, k, n)), jnp.int32).astype(dtype)
    scales = rng.uniform(0.5, 2.0, (num_layers, k_groups, n)) * rng.choice([1e-3, 0.03, 1.0], (1, 1, n))
    shift = None if not offsets else jnp.asarray(rng.standard_normal((num_layers, k_groups, n)) * 0.1, jnp.float32)
    return QuantizedWeight(values, jnp.asarray(scales, jnp.float32), shift)


def dequantized(w):
    """The float32 weights numpy computes (float(q) * s, rounded, then + o): QuantizedWeight.dequantize's."""
    group = w.values.shape[-2] // w.scales.shape[-2]
    out = np.asarray(w.values).astype(np.float32) * np.repeat(np.asarray(w.scales), group, axis=-2)
    return out if w.offsets is None else out + np.repeat(np.asarray(w.offsets), group, axis=-2)


def take_matmul_path(path, monkeypatch):
    switches = library.MATMUL_PATH_SWITCHES
    for name in {name for env in switches.values() for name in env}:
        monkeypatch.delenv(name, raising=False)
    for name, value in switches[path].items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offsets", [False, True], ids=["sym", "offsets"])
def test_pack_stacked_quantized_round_trips(seed, kind, offsets):
    """The packed QuantizedWeight has PACKED_RANK (the model's test for a packed kernel), int8 K rows or 4-bit
    ceil(K / 2) rows of pairs, and unpacks to the stack it came from."""
    rng = np.random.default_rng(seed)
    for _, k, n, groups, group in SHAPES:
        w = quantized_stack(rng, kind, 2, k, n, group, offsets)
        packed = native.pack_stacked(w, groups)
        assert packed.ndim == native.PACKED_RANK
        four = kind != "int8" and not (kind == "int4" and k == 1)
        assert packed.values.shape[3] == ((k + 1) // 2 if four else k)
        assert packed.scales.shape[3] == w.scales.shape[1]
        back = native.unpack_stacked(packed, k, n, groups)
        np.testing.assert_array_equal(np.asarray(back.values).astype(np.int32), np.asarray(w.values).astype(np.int32))
        np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(w.scales))
        assert (back.offsets is None) == (w.offsets is None)
        if offsets:
            np.testing.assert_array_equal(np.asarray(back.offsets), np.asarray(w.offsets))
        np.testing.assert_array_equal(np.asarray(back.dequantize()), dequantized(w))


def test_pack_stacked_nibble_order():
    """4-bit pairs: the even row in the low nibble, int4 as two's complement nibbles."""
    values = jnp.asarray(np.array([[1, 2], [-3, 7], [-8, 0]]).reshape(1, 3, 2), jnp.int4)
    w = QuantizedWeight(values, jnp.ones((1, 1, 2), jnp.float32))
    packed = np.asarray(native.pack_stacked(w).values).view(np.uint8)
    np.testing.assert_array_equal(packed[0, 0, 0, :, :2], [[0x1 | 0xD << 4, 0x2 | 0x7 << 4], [0x8, 0x0]])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offsets", [False, True], ids=["sym", "offsets"])
@pytest.mark.parametrize("path", ["default", "avx2", "portable"])
def test_quantized_matmul_is_the_float32_path_on_dequantized_weights(seed, kind, offsets, path, monkeypatch):
    """For every layer (and a clamped one), float32 x: the packed quantized matmul's bits are the float32 packed
    matmul's on the dequantized weights; bf16 x: those of x widened; round_to bfloat16 and rows < M as for the
    float path; every output written (poisoned buffer)."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    for m, k, n, groups, group in SHAPES:
        num_layers = 3
        w = quantized_stack(rng, kind, num_layers, k, n, group, offsets)
        packed, reference = native.pack_stacked(w, groups), native.pack_stacked(jnp.asarray(dequantized(w)), groups)
        matmul = functools.partial(native.stacked_matmul, n=n, groups=groups)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        poison = jnp.zeros((m, n), jnp.float32)
        what = f"{kind} offsets={offsets} M,K,N,groups,g={m, k, n, groups, group} seed={seed}"
        for layer in (1, 2, num_layers + 3):
            out = run_poisoned(lambda _, x, w, i: matmul(x, w, i), poison, x, packed, jnp.int32(layer))
            np.testing.assert_array_equal(np.asarray(out), np.asarray(matmul(x, reference, layer)),
                                          err_msg=f"{what} layer={layer}")
        want = np.asarray(x, np.float64) @ dequantized(w)[1].astype(np.float64)
        np.testing.assert_allclose(np.asarray(matmul(x, packed, 1)), want, rtol=1e-4, atol=1e-4 * np.sqrt(k),
                                   err_msg=what)
        x16 = x.astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(matmul(x16, packed, 1)),
                                      np.asarray(matmul(x16.astype(jnp.float32), reference, 1)),
                                      err_msg=f"{what} bf16 x")
        np.testing.assert_array_equal(np.asarray(matmul(x, packed, 1, round_to=jnp.bfloat16)),
                                      np.asarray(matmul(x, reference, 1, round_to=jnp.bfloat16)),
                                      err_msg=f"{what} round")
        real = m // 2
        out = np.asarray(run_poisoned(lambda _, x, w, r: matmul(x, w, 1, rows=r), poison, x, packed, jnp.int32(real)))
        np.testing.assert_array_equal(out[:real], np.asarray(matmul(x, reference, 1))[:real], err_msg=f"{what} rows")
        assert np.isnan(out[real:]).all(), f"{what}: padding rows written"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["default", "avx2", "portable"])
def test_quantized_matmul_k_blocks_and_many_rows(seed, kind, path, monkeypatch):
    """Rows in row blocks and parts (70, 130 rows), K in k blocks (FERRY_NATIVE_MATMUL_K_BLOCK: a group's span
    cut across tile calls), Llama's group of 128 over K = 1024: the float32 path's bits."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    for m, k, n, group in [(70, 1024, 130, 128), (130, 96, 64, 32), (9, 200, 70, None)]:
        w = quantized_stack(rng, kind, 2, k, n, group, True)
        packed, reference = native.pack_stacked(w), native.pack_stacked(jnp.asarray(dequantized(w)))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        want = np.asarray(native.stacked_matmul(x, reference, 1, n=n))
        for k_block in (None, "48"):
            if k_block is None:
                monkeypatch.delenv("FERRY_NATIVE_MATMUL_K_BLOCK", raising=False)
            else:
                monkeypatch.setenv("FERRY_NATIVE_MATMUL_K_BLOCK", k_block)
            np.testing.assert_array_equal(np.asarray(native.stacked_matmul(x, packed, 1, n=n)), want,
                                          err_msg=f"{kind} M,K,N,g={m, k, n, group} k_block={k_block} seed={seed}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path", ["default", "portable"])
def test_gated_quantized_matmul(seed, kind, dtype, path, monkeypatch):
    """A fused [gate | up] (groups 2, SiLU): the float32 packed path's gated result on the dequantized
    weights, bit for bit (the same sums through the same epilogue), and close to its parts through
    gated_activation."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    for m, k, half, group in [(1, 576, 96, 32), (4, 128, 100, 64), (7, 64, 35, None)]:
        w = quantized_stack(rng, kind, 2, k, 2 * half, group, kind != "int8")
        packed, reference = native.pack_stacked(w, 2), native.pack_stacked(jnp.asarray(dequantized(w)), 2)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        matmul = functools.partial(native.stacked_matmul, n=2 * half, groups=2)
        out = run_poisoned(lambda _, x, w: matmul(x, w, 1, gated="silu", dtype=dtype), jnp.zeros((m, half), dtype),
                           x, packed)
        want = matmul(x, reference, 1, gated="silu", dtype=dtype)
        f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
        np.testing.assert_array_equal(f32(out), f32(want), err_msg=f"{kind} M,K,I={m, k, half} seed={seed}")
        ref = gated_activation(matmul(x, packed, 1), dtype)
        np.testing.assert_allclose(f32(out), f32(ref), rtol=1e-5 if dtype == jnp.float32 else 2 ** -7, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offsets", [False, True], ids=["sym", "offsets"])
def test_packed_columns(seed, kind, offsets):
    """packed_columns: the dequantized columns of layer 0, as QuantizedWeight.dequantize gives them, for ids
    of any shape (a tied embedding's rows read from the packed LM head); float32 and bf16 stacks too."""
    rng = np.random.default_rng(seed)
    for k, n, group in [(576, 200, 32), (37, 70, None), (64, 1100, 16)]:
        w = quantized_stack(rng, kind, 2, k, n, group, offsets)
        packed = native.pack_stacked(w)
        ids = jnp.asarray(rng.integers(0, n, (3, 5)), jnp.int32)
        table = np.asarray(w.dequantize())[0].T  # [N, K]
        np.testing.assert_array_equal(np.asarray(native.packed_columns(packed, ids, k)), table[np.asarray(ids)])
        for dtype in (jnp.float32, jnp.bfloat16):
            dense = jnp.asarray(dequantized(w), dtype)
            np.testing.assert_array_equal(np.asarray(native.packed_columns(native.pack_stacked(dense), ids, k)),
                                          np.asarray(dense[0].astype(jnp.float32)).T[np.asarray(ids)])


def test_a_wrong_nibble_order_is_caught(seed):
    """The checks above see a kernel that reads the pairs' nibbles swapped: the same weights packed with the
    pairs' halves exchanged give other sums."""
    rng = np.random.default_rng(seed)
    w = quantized_stack(rng, "int4", 1, 64, 64, 32, True)
    packed = native.pack_stacked(w)
    bits = jax.lax.bitcast_convert_type(packed.values, jnp.uint8)
    swapped = jax.lax.bitcast_convert_type((bits >> 4) | (bits << 4), jnp.int8)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    right = native.stacked_matmul(x, packed, 0, n=64)
    wrong = native.stacked_matmul(x, QuantizedWeight(swapped, packed.scales, packed.offsets), 0, n=64)
    assert not np.array_equal(np.asarray(right), np.asarray(wrong))


def test_quantized_matmul_rejects_bad_inputs():
    k_values = jnp.zeros((2, 8, 4), jnp.int8)
    w = QuantizedWeight(k_values, jnp.ones((2, 1, 4), jnp.float32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        native.pack_stacked(QuantizedWeight(k_values.astype(jnp.float8_e4m3fn), w.scales))
    with pytest.raises(ValueError, match="G dividing K"):
        native.pack_stacked(QuantizedWeight(k_values, jnp.ones((2, 3, 4), jnp.float32)))
    with pytest.raises(ValueError, match="G dividing K"):
        native.pack_stacked(QuantizedWeight(k_values, w.scales, jnp.ones((2, 1, 5), jnp.float32)))
    with pytest.raises(ValueError, match="even group size"):
        native.pack_stacked(QuantizedWeight(jnp.zeros((1, 6, 4), jnp.int4), jnp.ones((1, 2, 4), jnp.float32)))
    packed = native.pack_stacked(w)
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"for x \[..., K\]"):
        native.stacked_matmul(x[:, :6], packed, 0, n=4)
    with pytest.raises(ValueError, match="groups=2"):
        native.stacked_matmul(x, packed, 0, n=4, groups=2)
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        native.stacked_matmul(x.astype(jnp.float16), packed, 0, n=4)
    with pytest.raises(ValueError, match="quantized weights"):
        native.stacked_matmul(x, QuantizedWeight(packed.values.astype(jnp.int16), packed.scales), 0, n=4)
    with pytest.raises(ValueError, match="round_to"):
        native.stacked_matmul(x, packed, 0, n=4, round_to=jnp.float16)
