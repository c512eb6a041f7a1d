"""The native grouped matmul (a mixture of experts' ragged dot over one layer's experts of a packed stack of every
layer's) against jax.lax.ragged_dot, and bit for bit against the stacked matmul run on each expert's rows alone.
Like the other native tests, these FAIL, never skip, without the library."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import run_poisoned
from models.quantization import QuantizedWeight
from pallas_kernels.native import library
from pallas_kernels.native import ops as native
from pallas_kernels.ops import gated_activation, packed_grouped_matmul

pytestmark = pytest.mark.usefixtures("native_library")

NUM_LAYERS = 3

# (M, K, N, experts, groups): one row and many, M off the tiles' row blocks (6) and past a row group (48), K off
# 16 (odd: a bf16 panel's last pair half empty), N off whole panels, two column parts padded apart, an expert with
# enough rows for row parts (300 rows of one or two experts).
SHAPES = [(1, 64, 96, 4, 1), (7, 37, 130, 8, 2), (13, 33, 70, 3, 1), (50, 100, 200, 8, 2), (5, 129, 64, 1, 1),
          (300, 64, 260, 2, 2), (64, 1, 17, 6, 1)]


def take_matmul_path(path, monkeypatch):
    """library.MATMUL_PATH_SWITCHES[path] set, the other switches unset."""
    switches = library.MATMUL_PATH_SWITCHES
    for name in {name for env in switches.values() for name in env}:
        monkeypatch.delenv(name, raising=False)
    for name, value in switches[path].items():
        monkeypatch.setenv(name, value)


def group_sizes_cases(rng, m, experts):
    """Sizes that cover all M rows, leave rows past the groups (other devices' experts), give one expert every
    row (the others empty), and none at all; random ones with empty groups among them."""
    cases = [np.zeros(experts, np.int64)]
    every = np.zeros(experts, np.int64)
    every[rng.integers(experts)] = m
    cases.append(every)
    for total in (m, m - m // 3):
        cuts = np.sort(rng.integers(0, total + 1, experts - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [total]]))
        if experts > 2:
            sizes[rng.integers(experts)] += sizes[0]  # an empty first group among the others
            sizes[0] = 0
        cases.append(sizes)
    return [jnp.asarray(sizes, jnp.int32) for sizes in cases]


def ragged_reference(x, w, group_sizes):
    """jax.lax.ragged_dot in float32: rows past the groups zeros."""
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), group_sizes,
                              precision=jax.lax.Precision.HIGHEST)


def per_expert(x, packed, first, group_sizes, width, **kwargs):
    """The stacked matmul on each expert's rows alone (its stack entry first + e), zeros past the groups: what
    the grouped call must give bit for bit."""
    out = np.zeros((x.shape[0], width), np.float32)
    row = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        if size:
            rows = native.stacked_matmul(x[row:row + size], packed, first + e, **kwargs)
            out[row:row + size] = np.asarray(rows.astype(jnp.float32))
        row += size
    return out


@pytest.mark.parametrize("x_dtype,w_dtype,path", [
    (jnp.float32, jnp.float32, "default"), (jnp.float32, jnp.float32, "avx2"),
    (jnp.float32, jnp.float32, "portable"), (jnp.float32, jnp.bfloat16, "default"),
    (jnp.bfloat16, jnp.bfloat16, "default"), (jnp.bfloat16, jnp.bfloat16, "portable")],
    ids=["f32", "f32-avx2", "f32-portable", "bf16w", "bf16", "bf16-portable"])
def test_grouped_matmul_matches_ragged_dot(seed, x_dtype, w_dtype, path, monkeypatch):
    """Each expert's rows through its layer's stack entry (layers past 0), empty groups, one group of every row,
    rows past the groups zeros (poisoned output: every element written); within the stacked matmul tests'
    tolerance of ragged_dot, and each expert's rows the bits of the stacked matmul on them alone, on one thread
    and on the pool."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    for m, k, n, experts, groups in SHAPES:
        w = jnp.asarray(rng.standard_normal((NUM_LAYERS, experts, k, n)), w_dtype)
        packed = native.pack_stacked(w.reshape(NUM_LAYERS * experts, k, n), groups)
        x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
        grouped = functools.partial(native.grouped_matmul, n=n, groups=groups)
        poison = jnp.zeros((m, n), jnp.float32)
        for layer in (1, NUM_LAYERS - 1):
            first = layer * experts
            for sizes in group_sizes_cases(rng, m, experts):
                out = np.asarray(run_poisoned(lambda _, x, w, f, g: grouped(x, w, f, g), poison, x, packed,
                                              jnp.int32(first), sizes))
                what = f"M,K,N,E,groups={m, k, n, experts, groups} layer={layer} sizes={sizes} seed={seed}"
                ref = np.asarray(ragged_reference(x, w[layer], sizes))
                np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=what)
                assert not out[int(sizes.sum()):].any(), what  # rows past the groups: zeros
                want = per_expert(x, packed, first, sizes, n, n=n, groups=groups)
                np.testing.assert_array_equal(out, want, err_msg=what)
        sizes = group_sizes_cases(rng, m, experts)[-1]
        pooled = np.asarray(grouped(x, packed, experts, sizes))
        for threads in ("1", "7"):  # one thread; more than the pool has (late helpers, their items taken)
            monkeypatch.setenv("FERRY_NATIVE_ATTENTION_THREADS", threads)
            np.testing.assert_array_equal(np.asarray(grouped(x, packed, experts, sizes)), pooled,
                                          err_msg=f"{threads} thread(s)")
        monkeypatch.delenv("FERRY_NATIVE_ATTENTION_THREADS")


@pytest.mark.parametrize("x_dtype,w_dtype,path", [
    (jnp.float32, jnp.float32, "default"), (jnp.float32, jnp.float32, "portable"),
    (jnp.bfloat16, jnp.bfloat16, "default"), (jnp.bfloat16, jnp.bfloat16, "avx2")],
    ids=["f32", "f32-portable", "bf16", "bf16-avx2"])
def test_gated_grouped_matmul(seed, x_dtype, w_dtype, path, monkeypatch):
    """gated="silu": the fused [gate | up] activation of each expert's sums in the model's dtype, the bits of the
    gated stacked matmul on each expert's rows alone, near gated_activation of the ragged dot's sums; rows past
    the groups zeros in that dtype too."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if x_dtype == jnp.bfloat16 else jnp.float32
    for m, k, half, experts in [(1, 64, 96, 4), (9, 33, 35, 8), (50, 100, 100, 6), (200, 64, 72, 2)]:
        w = jnp.asarray(rng.standard_normal((NUM_LAYERS, experts, k, 2 * half)) / np.sqrt(k) * 3, w_dtype)
        packed = native.pack_stacked(w.reshape(NUM_LAYERS * experts, k, 2 * half), 2)
        x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
        first = 2 * experts  # layer 2
        poison = jnp.zeros((m, half), dtype)
        kwargs = dict(n=2 * half, groups=2, gated="silu", dtype=dtype)
        for sizes in group_sizes_cases(rng, m, experts):
            what = f"M,K,I,E={m, k, half, experts} sizes={sizes} seed={seed}"
            out = run_poisoned(lambda _, x, w, g: native.grouped_matmul(x, w, first, g, **kwargs), poison, x,
                               packed, sizes)
            out = np.asarray(out.astype(jnp.float32))
            np.testing.assert_array_equal(out, per_expert(x, packed, first, sizes, half, **kwargs), err_msg=what)
            assert not out[int(sizes.sum()):].any(), what
            ref = np.asarray(gated_activation(ragged_reference(x, w[2], sizes), dtype, "silu").astype(jnp.float32))
            rtol = 1e-4 if dtype == jnp.float32 else 2 ** -7
            np.testing.assert_allclose(out, ref, rtol=rtol, atol=1e-4 * np.sqrt(k), err_msg=what)


@pytest.mark.parametrize("kind,dtype", [("int8", jnp.int8), ("int4", jnp.int4), ("uint4", jnp.uint4)])
def test_quantized_grouped_matmul(seed, kind, dtype):
    """A packed QuantizedWeight stack (groups of 32 rows of K, offsets): each expert's rows the bits of the
    quantized stacked matmul on them alone, within tolerance of ragged_dot on the dequantized weights; gated
    too."""
    rng = np.random.default_rng(seed)
    lo, hi = {"int8": (-128, 128), "int4": (-8, 8), "uint4": (0, 16)}[kind]
    m, k, n, experts = 40, 64, 130, 4
    values = jnp.asarray(rng.integers(lo, hi, (NUM_LAYERS * experts, k, n)), jnp.int32).astype(dtype)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (NUM_LAYERS * experts, k // 32, n)) * 0.03, jnp.float32)
    offsets = jnp.asarray(rng.standard_normal((NUM_LAYERS * experts, k // 32, n)) * 0.01, jnp.float32)
    w = QuantizedWeight(values, scales, offsets)
    packed = native.pack_stacked(w, 2)
    dense = np.asarray(values).astype(np.float32) * np.repeat(np.asarray(scales), 32, axis=1)
    dense = (dense + np.repeat(np.asarray(offsets), 32, axis=1)).reshape(NUM_LAYERS, experts, k, n)
    for x_dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
        for sizes in group_sizes_cases(rng, m, experts):
            what = f"{kind} x {jnp.dtype(x_dtype)} sizes={sizes} seed={seed}"
            out = np.asarray(native.grouped_matmul(x, packed, experts, sizes, n=n, groups=2))
            np.testing.assert_array_equal(out, per_expert(x, packed, experts, sizes, n, n=n, groups=2), err_msg=what)
            ref = np.asarray(ragged_reference(x, jnp.asarray(dense[1]), sizes))
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=what)
            gated = dict(n=n, groups=2, gated="silu", dtype=jnp.bfloat16)
            out = np.asarray(native.grouped_matmul(x, packed, experts, sizes, **gated).astype(jnp.float32))
            np.testing.assert_array_equal(out, per_expert(x, packed, experts, sizes, n // 2, **gated), err_msg=what)


def test_grouped_matmul_compiles_once_for_any_group_sizes(seed):
    """group_sizes and first are operands: one compilation serves every routing of a step (and every layer)."""
    rng = np.random.default_rng(seed)
    m, k, n, experts = 16, 32, 64, 4
    w = jnp.asarray(rng.standard_normal((2 * experts, k, n)), jnp.float32)
    packed = native.pack_stacked(w)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    step = jax.jit(lambda x, w, f, g: packed_grouped_matmul(x, w, f, g, n=n))
    for layer, sizes in enumerate(group_sizes_cases(rng, m, experts)):
        first = layer % 2 * experts
        out = np.asarray(step(x, packed, jnp.int32(first), sizes))
        np.testing.assert_array_equal(out, per_expert(x, packed, first, sizes, n, n=n))
    assert step._cache_size() == 1


def test_grouped_matmul_clamps_first_and_sizes(seed):
    """first clamped into [0, L * E - E] like a dynamic slice of E entries; groups past M cut at M; negative
    sizes count as empty."""
    rng = np.random.default_rng(seed)
    m, k, n, experts = 10, 16, 20, 3
    w = jnp.asarray(rng.standard_normal((2, experts, k, n)), jnp.float32)
    packed = native.pack_stacked(w.reshape(2 * experts, k, n))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray([4, 3, 3], jnp.int32)
    last = np.asarray(native.grouped_matmul(x, packed, experts, sizes, n=n))
    np.testing.assert_array_equal(np.asarray(native.grouped_matmul(x, packed, 100, sizes, n=n)), last)
    np.testing.assert_array_equal(np.asarray(native.grouped_matmul(x, packed, -5, sizes, n=n)),
                                  np.asarray(native.grouped_matmul(x, packed, 0, sizes, n=n)))
    past = np.asarray(native.grouped_matmul(x, packed, experts, jnp.asarray([4, -2, 30], jnp.int32), n=n))
    np.testing.assert_array_equal(past, per_expert(x, packed, experts, np.array([4, 0, 6]), n, n=n))


def test_grouped_matmul_rejects_bad_inputs():
    x, w = jnp.zeros((2, 8), jnp.float32), native.pack_stacked(jnp.zeros((4, 8, 4), jnp.float32))
    sizes = jnp.asarray([1, 1], jnp.int32)
    with pytest.raises(ValueError, match="float32"):
        native.grouped_matmul(x.astype(jnp.bfloat16), w, 0, sizes, n=4)  # bf16 x only under bf16 weights
    with pytest.raises(ValueError, match=r"pack_stacked\(w \[L, K, 4\]"):
        native.grouped_matmul(x, jnp.zeros((4, 8, 4), jnp.float32), 0, sizes, n=4)  # not packed
    with pytest.raises(ValueError, match="group_sizes"):
        native.grouped_matmul(x, w, 0, jnp.ones(5, jnp.int32), n=4)  # more experts than entries
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        native.grouped_matmul(x[None], w, 0, sizes, n=4)
    with pytest.raises(ValueError, match="groups 2"):
        native.grouped_matmul(x, w, 0, sizes, n=4, gated="silu")
