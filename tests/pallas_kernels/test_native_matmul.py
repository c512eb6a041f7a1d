"""The native CPU library's other kernels (pallas_kernels/native/ops.py) against jnp: the stacked matmul over
packed weight stacks (plain and gated, every path a CPU has), RMSNorm, and the scanned layers reading packed
kernels in place. Like tests/pallas_kernels/test_native_kernel.py, these FAIL, never skip, without the library."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import run_poisoned
from pallas_kernels.native import library
from pallas_kernels.native import ops as native
from pallas_kernels.ops import gated_activation

pytestmark = pytest.mark.usefixtures("native_library")


# ----------------------------------------------------------------------------- stacked matmul

STACKED_MATMUL_SHAPES = [  # (M, K, N, groups): odd sizes, one row and many, odd K (a bf16 panel's last pair
    # half empty), panels of 64 columns and their tails, two column parts padded apart, and rows in parts
    # (70 rows of 4 panels: parts of 24 rows or more; 260 of 18: the long parts, 128 rows or more)
    (1, 1, 1, 1), (1, 576, 1728, 2), (1, 37, 1050, 1), (1, 1027, 520, 2), (5, 33, 70, 2), (7, 129, 17, 1),
    (16, 256, 1024, 1), (13, 100, 129, 1), (70, 64, 200, 2), (2, 96, 200, 1), (9, 65, 130, 2), (260, 32, 1100, 1)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pack_stacked_round_trips(seed, dtype):
    """pack_stacked's panels hold every weight once, where unpack_stacked finds it, and zeros elsewhere
    (the padding the tiles read past a part's last column and a bf16 panel's odd K)."""
    rng = np.random.default_rng(seed)
    for _, k, n, groups in STACKED_MATMUL_SHAPES:
        w = jnp.asarray(rng.standard_normal((2, k, n)) + 3, dtype)  # no zero weights
        packed = native.pack_stacked(w, groups)
        assert packed.shape == native.packed_shape(2, k, n, dtype, groups)
        np.testing.assert_array_equal(np.asarray(native.unpack_stacked(packed, k, n, groups)), np.asarray(w))
        assert int((packed != 0).sum()) == w.size


def take_matmul_path(path, monkeypatch):
    """library.MATMUL_PATH_SWITCHES[path] set, the other switches unset (AVX2 where the CPU has no AVX2 and
    FMA: the portable loops)."""
    switches = library.MATMUL_PATH_SWITCHES
    for name in {name for env in switches.values() for name in env}:
        monkeypatch.delenv(name, raising=False)
    for name, value in switches[path].items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("x_dtype,w_dtype,path", [
    (jnp.float32, jnp.float32, "default"), (jnp.float32, jnp.float32, "avx2"),
    (jnp.float32, jnp.float32, "portable"),
    (jnp.float32, jnp.bfloat16, "default"), (jnp.float32, jnp.bfloat16, "avx2"),
    (jnp.float32, jnp.bfloat16, "portable"),
    (jnp.bfloat16, jnp.bfloat16, "default"),  # the bf16 dot instruction where the CPU has it
    (jnp.bfloat16, jnp.bfloat16, "widened"), (jnp.bfloat16, jnp.bfloat16, "avx2"),
    (jnp.bfloat16, jnp.bfloat16, "portable")],
    ids=["f32", "f32-avx2", "f32-portable", "bf16w", "bf16w-avx2", "bf16w-portable", "bf16", "bf16-widened",
         "bf16-avx2", "bf16-portable"])
def test_stacked_matmul_matches_dot(seed, x_dtype, w_dtype, path, monkeypatch):
    """x @ w[layer] for every layer of a random packed stack (poisoned output buffer), out-of-range
    layers clamped like a dynamic slice, the same bits on one thread as on the pool, and a row's bits
    the same alone as in a batch. bfloat16 inputs: the float64 product of their exact float32 values."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    for m, k, n, groups in STACKED_MATMUL_SHAPES:
        num_layers = 3
        w = jnp.asarray(rng.standard_normal((num_layers, k, n)), w_dtype)
        packed = native.pack_stacked(w, groups)
        matmul = functools.partial(native.stacked_matmul, n=n, groups=groups)
        x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
        poison = jnp.zeros((m, n), jnp.float32)  # shape of the output, for run_poisoned
        for layer in [*range(num_layers), -1, num_layers]:
            ref = (np.asarray(x.astype(jnp.float32), np.float64)
                   @ np.asarray(w[min(max(layer, 0), num_layers - 1)].astype(jnp.float32), np.float64))
            out = run_poisoned(lambda _, x, w, i: matmul(x, w, i), poison, x, packed, jnp.int32(layer))
            np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4 * np.sqrt(k),
                                       err_msg=f"M,K,N,groups={m, k, n, groups} layer={layer} seed={seed}")
        pooled = matmul(x, packed, 1)
        for threads in ("1", "7"):  # one thread; more than the pool has (late helpers, their items taken)
            monkeypatch.setenv("FERRY_NATIVE_ATTENTION_THREADS", threads)
            again = run_poisoned(lambda _, x, w, i: matmul(x, w, i), poison, x, packed, jnp.int32(1))
            np.testing.assert_array_equal(np.asarray(again), np.asarray(pooled), err_msg=f"{threads} thread(s)")
        monkeypatch.delenv("FERRY_NATIVE_ATTENTION_THREADS")
        # Every row count sums in one order: a row's bits do not depend on the batch
        batch = x if m > 1 else jnp.concatenate([x, x])
        np.testing.assert_array_equal(np.asarray(matmul(batch[-1:], packed, 1))[0],
                                      np.asarray(matmul(batch, packed, 1))[-1])
        # round_to: the sums at that dtype's precision, as XLA's converts to it and back give them
        sums = matmul(x, packed, 1)
        for dtype in (jnp.bfloat16, jnp.float32):
            np.testing.assert_array_equal(np.asarray(matmul(x, packed, 1, round_to=dtype)),
                                          np.asarray(sums.astype(dtype).astype(jnp.float32)))
        # rows: only x's first `rows` (clamped into [0, M]) are computed, each as in the whole batch; the
        # rest (a bucketed step's padding) is left unwritten
        for rows in {0, m // 2, m - 1, m, m + 3, -2}:
            real = min(max(rows, 0), m)
            out = np.asarray(run_poisoned(lambda _, x, w, r: matmul(x, w, 1, rows=r), poison, x, packed,
                                          jnp.int32(rows)))
            np.testing.assert_array_equal(out[:real], np.asarray(sums)[:real], err_msg=f"rows={rows}")
            assert np.isnan(out[real:]).all(), f"rows={rows}: padding rows written"


@pytest.mark.parametrize("x_dtype,w_dtype,path", [
    (jnp.float32, jnp.float32, "default"), (jnp.float32, jnp.float32, "avx2"),
    (jnp.float32, jnp.float32, "portable"), (jnp.float32, jnp.bfloat16, "default"),
    (jnp.bfloat16, jnp.bfloat16, "default"), (jnp.bfloat16, jnp.bfloat16, "widened"),
    (jnp.bfloat16, jnp.bfloat16, "avx2"), (jnp.bfloat16, jnp.bfloat16, "portable")],
    ids=["f32", "f32-avx2", "f32-portable", "bf16w", "bf16", "bf16-widened", "bf16-avx2", "bf16-portable"])
@pytest.mark.parametrize("act", native.GATED_ACTIVATIONS)
def test_gated_stacked_matmul_matches_its_parts(seed, x_dtype, w_dtype, path, act, monkeypatch):
    """The gated matmul (the activation applied per panel pair on AVX-512, in one pass after the sums
    elsewhere) against the plain matmul's sums through gated_activation, in the model's dtype: float32
    within a few ulp, bfloat16 within one bfloat16 ulp where an exp's last bit moves a rounding. Panel
    tails on both halves (I not a multiple of 64), one row and many, every output element written."""
    take_matmul_path(path, monkeypatch)
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if x_dtype == jnp.bfloat16 or w_dtype == jnp.bfloat16 else jnp.float32
    moved = np.zeros(2, np.int64)  # bf16 outputs that differ, outputs
    for m, k, half in [(1, 64, 96), (2, 48, 100), (5, 33, 35), (9, 64, 72), (13, 128, 128), (70, 64, 200)]:
        w = jnp.asarray(rng.standard_normal((2, k, 2 * half)) / np.sqrt(k) * 3, w_dtype)
        packed = native.pack_stacked(w, 2)
        x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
        poison = jnp.zeros((m, half), dtype)
        matmul = functools.partial(native.stacked_matmul, n=2 * half, groups=2)
        out = run_poisoned(lambda _, x, w: matmul(x, w, 1, gated=act, dtype=dtype), poison, x, packed)
        ref = gated_activation(matmul(x, packed, 1), dtype, act)
        # k blocks of 16: the gate's and up's sums carried in the row group's scratch over tile calls
        monkeypatch.setenv("FERRY_NATIVE_MATMUL_K_BLOCK", "16")
        blocked = matmul(x, packed, 1, gated=act, dtype=dtype)
        monkeypatch.delenv("FERRY_NATIVE_MATMUL_K_BLOCK")
        np.testing.assert_array_equal(np.asarray(blocked.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)),
                                      err_msg=f"M,K,I={m, k, half}: k blocks of 16")
        real = m // 2  # rows: the first ones computed alike, the rest unwritten
        part = run_poisoned(lambda _, x, w: matmul(x, w, 1, gated=act, dtype=dtype, rows=real), poison, x, packed)
        np.testing.assert_array_equal(np.asarray(part[:real].astype(jnp.float32)),
                                      np.asarray(out[:real].astype(jnp.float32)), err_msg=f"M={m} rows={real}")
        assert np.isnan(np.asarray(part[real:].astype(jnp.float32))).all(), f"M={m}: padding rows written"
        out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
        # Absolute slack for GELU's tail, where 1 + tanh(z) cancels: two tanh approximations 1e-7 apart
        # differ there by ~1e-6 of |gate|.
        rtol = 1e-5 if dtype == jnp.float32 else 2 ** -7
        atol = 1e-6 * max(float(np.abs(ref).max()), 1.0)
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol, err_msg=f"M,K,I={m, k, half} seed={seed}")
        moved += [(out != ref).sum(), out.size]
    if dtype == jnp.bfloat16:
        # An exp's last bit rarely moves a rounding. GELU's tail cancels (1 + tanh(z) near 0), where any
        # float32 evaluation moves ~7% of roundings from float64's (this kernel's and jnp's alike).
        limit = 0.01 if act == "silu" else 0.1
        assert moved[0] < limit * moved[1], f"{moved[0]} of {moved[1]} bf16 outputs moved seed={seed}"


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16w"])
def test_stacked_matmul_paths_agree_bit_for_bit(seed, w_dtype, monkeypatch):
    """Float32 x: every path sums each column over k in order, one FMA per term, so the AVX-512 tiles,
    the AVX2 tiles and the portable loops (their FMA clone) give the same bits in every panel tail and row
    block. Needs AVX2 and FMA: without them the portable loops multiply and add apart."""
    if not {"avx2", "fma"} <= library.cpu_flags():
        pytest.skip("the CPU lacks AVX2/FMA (or /proc/cpuinfo): the portable loops take no FMA clone")
    rng = np.random.default_rng(seed)
    # every tile height (rows 1-6: 1 and 2 take wider strips on AVX2; 10, 64, 70: blocks of 5), panel tails,
    # odd K, K past the AVX2 tiles' k block (512) under many row blocks, row groups of 48 and their tails
    for m, k, n, groups in [(1, 37, 1050, 1), (2, 70, 300, 1), (9, 65, 130, 2), (13, 129, 200, 2), (70, 64, 520, 2),
                            (7, 512, 64, 1), (5, 33, 100, 1), (64, 1101, 130, 1), (10, 600, 70, 2)]:
        w = jnp.asarray(rng.standard_normal((2, k, n)), w_dtype)
        packed = native.pack_stacked(w, groups)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        outs = {}
        # k blocks of 32 (FERRY_NATIVE_MATMUL_K_BLOCK): a column's sum carried over many tile calls
        for path, k_block in [("default", None), ("default", "32"), ("avx2", None), ("avx2", "32"),
                              ("portable", None)]:
            take_matmul_path(path, monkeypatch)
            if k_block is None:
                monkeypatch.delenv("FERRY_NATIVE_MATMUL_K_BLOCK", raising=False)
            else:
                monkeypatch.setenv("FERRY_NATIVE_MATMUL_K_BLOCK", k_block)
            outs[path, k_block] = np.asarray(native.stacked_matmul(x, packed, 1, n=n, groups=groups))
        for (path, k_block), out in outs.items():
            np.testing.assert_array_equal(out, outs["portable", None],
                                          err_msg=f"{path} k_block={k_block} M,K,N={m, k, n}")


def test_gated_bf16_rounding_by_the_cpus_conversion_is_the_integer_rounding(seed, monkeypatch):
    """A bf16 SiLU gate's three roundings by AVX512-BF16's conversion (where the CPU has it) give the
    integer rounding's bits. x float32 under bf16 weights: both runs sum through the same widened tiles, so
    only the roundings differ (FERRY_NATIVE_MATMUL_NO_BF16_DOT=1 takes the integer ones). Gates from -200 to
    200 reach exp's clamps; ties at bfloat16's precision come from the product of two bf16 values."""
    rng = np.random.default_rng(seed)
    m, k, half = 37, 96, 200
    w = jnp.asarray(rng.standard_normal((2, k, 2 * half)) * rng.choice([0.02, 0.3, 3.0], (1, 1, 2 * half)),
                    jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    matmul = jax.jit(lambda x, w: native.stacked_matmul(x, w, 1, n=2 * half, groups=2, gated="silu",
                                                        dtype=jnp.bfloat16))
    packed = native.pack_stacked(w, 2)
    converted = np.asarray(matmul(x, packed).astype(jnp.float32))
    monkeypatch.setenv("FERRY_NATIVE_MATMUL_NO_BF16_DOT", "1")
    integer = np.asarray(matmul(x, packed).astype(jnp.float32))
    assert np.abs(converted).max() > 50 and (converted == 0).mean() < 0.01  # the clamps reached, no rows lost
    np.testing.assert_array_equal(converted, integer)


def test_stacked_matmul_rejects_bad_inputs():
    x, w = jnp.zeros((2, 8), jnp.float32), native.pack_stacked(jnp.zeros((3, 8, 4), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        native.stacked_matmul(x.astype(jnp.bfloat16), w, 0, n=4)  # bf16 x only under bf16 weights
    with pytest.raises(ValueError, match="bfloat16 weights"):
        native.stacked_matmul(x, w.astype(jnp.float16), 0, n=4)
    with pytest.raises(ValueError, match=r"pack_stacked\(w \[L, K, 4\]"):
        native.stacked_matmul(x, jnp.zeros((3, 8, 4), jnp.float32), 0, n=4)  # not packed
    with pytest.raises(ValueError, match=r"for x \[..., K\]"):
        native.stacked_matmul(x[:, :5], w, 0, n=4)
    with pytest.raises(ValueError, match="groups=2"):
        native.stacked_matmul(x, w, 0, n=4, groups=2)  # packed as one part
    with pytest.raises(ValueError, match="groups 2"):
        native.stacked_matmul(x, w, 0, n=4, gated="silu")
    with pytest.raises(ValueError, match="round_to"):
        native.stacked_matmul(x, w, 0, n=4, round_to=jnp.float16)
    with pytest.raises(ValueError, match="equal parts"):
        native.pack_stacked(jnp.zeros((1, 8, 5)), 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("path", ["default", "portable"])
def test_rms_norm_matches_the_model_norm(seed, dtype, offset, path, monkeypatch):
    """native.rms_norm against the model's jnp RMSNorm: rows of a decode batch and of a prefill chunk
    (threads split those), an odd width, with and without the residual add (its branch float32 sums or the
    model's dtype). The sum is exactly x + delta.astype(dtype); the norm within a few float32 ulp (another
    summation order and rsqrt), bf16 rarely apart where that moves a rounding. Every element written."""
    from models.transformer import ForwardContext, RMSNorm
    from pallas_kernels.kernels import Kernels
    take_matmul_path(path, monkeypatch)
    ctx = ForwardContext(Kernels("cpu", "reference", native=False))  # the model's jnp norm
    rng = np.random.default_rng(seed)
    moved = np.zeros(2, np.int64)  # bf16 outputs that differ, outputs
    for m, k in [(1, 64), (5, 33), (70, 512), (300, 256)]:
        norm = RMSNorm(k, 1e-6, offset, dtype)
        norm.weight[...] = jnp.asarray(rng.standard_normal(k) * 0.5 + 1.0 - offset, dtype)
        x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10), dtype)
        f32 = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
        for delta_dtype in (None, jnp.float32, dtype):
            delta = None if delta_dtype is None else jnp.asarray(rng.standard_normal((m, k)) * 2, delta_dtype)
            call = functools.partial(native.rms_norm, eps=norm.eps, offset=offset)
            if delta is None:
                out, ref = run_poisoned(call, x, norm.weight[...]), norm(x, ctx)
            else:
                out = run_poisoned(lambda x, w, d: call(x, w, delta=d)[0], x, norm.weight[...], delta)
                total = run_poisoned(lambda x, w, d: call(x, w, delta=d)[1], x, norm.weight[...], delta)
                want_total = x + delta.astype(dtype)
                np.testing.assert_array_equal(f32(total), f32(want_total))
                ref = norm(want_total, ctx)  # the norm of the rounded sum, as transformers takes it
            out, ref = f32(out), f32(ref)
            # bf16: a normed value one ulp apart, times w and rounded again, is up to two ulp apart
            rtol = 1e-5 if dtype == jnp.float32 else 2 ** -6
            np.testing.assert_allclose(out, ref, rtol=rtol, atol=1e-6, err_msg=f"M,K={m, k} delta {delta_dtype}")
            moved += [(out != ref).sum(), out.size]
    if dtype == jnp.bfloat16:
        assert moved[0] < 0.01 * moved[1], f"{moved[0]} of {moved[1]} bf16 outputs moved seed={seed}"


def test_rms_norm_rejects_bad_inputs():
    x = jnp.zeros((2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        native.rms_norm(x, jnp.ones(8, jnp.float32), eps=1e-6)  # weight of another dtype
    with pytest.raises(ValueError, match="weight"):
        native.rms_norm(x, jnp.ones(4, jnp.bfloat16), eps=1e-6)
    with pytest.raises(ValueError, match="delta"):
        native.rms_norm(x, jnp.ones(8, jnp.bfloat16), eps=1e-6, delta=jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="delta"):
        native.rms_norm(x, jnp.ones(8, jnp.bfloat16), eps=1e-6, delta=jnp.zeros((2, 8), jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_scanned_layers_read_packed_kernels_in_place(seed, dtype):
    """With the kernels packed (pack_kernels, as the engine does on CPU), the compiled decode and prefill
    steps run the scanned layers' four linears as stacked-matmul custom calls on the whole packed stacks
    (and the untied LM head on its own), each told the step's real rows (its padding skipped), and no
    dynamic-slice or copy of a layer's [K, N] kernel is left
    (XLA CPU copied one per layer per step), nor a float32 copy of a bfloat16 stack (XLA CPU widens a bf16
    scan operand whole, every step). Logits match the unpacked model's (XLA's dots on the scan's slices)."""
    from engine.worker.packing import SeqSlice, StepLayout, pack
    from engine.worker.step import model_step
    from models.config import ModelConfig
    from models.loading import random_model
    from models.paged import init_kv_cache
    from models.transformer import pack_kernels
    from pallas_kernels.kernels import Kernels

    cfg = ModelConfig(model_type="llama", vocab_size=160, hidden_size=64, intermediate_size=96,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    model = random_model(cfg, dtype, seed=seed % (1 << 30))
    packed_state = pack_kernels(model.graphdef, model.state)
    kernel_shapes = {f"{k},{n}]" for k, n in [(64, 160), (64, 128), (64, 64), (64, 192), (96, 64)]}  # [.., K, N]
    rng = np.random.default_rng(seed)
    seqs = [SeqSlice([int(rng.integers(0, 128))], 5 + i, [1 + i]) for i in range(4)]
    decode, prefill = StepLayout(4, 4, 1, 4, decode=True), StepLayout(16, 4, 1, 4, decode=False)

    kernels = Kernels.for_platform("cpu", dtype)

    def args(layout, state):
        cache = init_kv_cache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        return model.graphdef, state, cache, pack(seqs, layout, 16), layout, kernels

    dt = 'f32' if dtype == jnp.float32 else 'bf16'
    for layout in (decode, prefill):
        lines = model_step.lower(*args(layout, packed_state)).compile().as_text().splitlines()
        call_lines = [line for line in lines if "ferry_stacked_matmul" in line and "custom-call(" in line]
        calls = [line.split("operand_layout_constraints")[1] for line in call_lines]
        # The layers' four linears and the LM head (a stack of one); a prefill step runs its last layer apart,
        # past the QKV projection on its logits rows alone (one per sequence): four more, three on x [S, K].
        apart = not layout.decode
        assert len(calls) == 5 + 4 * apart, calls
        x_rows = collections.Counter(int(line.split("[")[1].split(",")[0]) for line in calls)
        assert x_rows == ({16: 5, 4: 4} if apart else {4: 5}), x_rows
        # Each takes the step's real rows (its last operand) from the buffer, not a constant: padding skipped
        rows_operands = [line.split("custom-call(")[1].split(")")[0].split(", ")[-1] for line in call_lines]
        assert not [r for r in rows_operands if r.startswith("%constant")], rows_operands
        assert sum(f"{dt}[{cfg.num_layers}," in line for line in calls) == 4 + 4 * apart, calls
        assert sum(f"{dt}[1," in line for line in calls) == 1, calls
        copies = [line for line in lines if ("dynamic-slice(" in line or " copy(" in line or " convert(" in line)
                  and any(s in line.split("=")[1].split("{")[0] for s in kernel_shapes)]
        assert not copies, copies
        # Each layer's two norms: one native call each, the second with the residual add before it
        for target in ("ferry_rms_norm", "ferry_add_rms_norm"):
            assert sum(f'custom_call_target="{target}"' in line for line in lines) == 1 + apart, target
        # The head's float32 sums leave the kernel at bf16's precision: no bf16 logits array, no converts
        bf16_logits = [line for line in lines if f"bf16[{layout.num_logits},{cfg.vocab_size}]" in line]
        assert not bf16_logits, bf16_logits

    unpacked = model_step(*args(decode, model.state))[0]
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: one rounding of each linear's float32 sum, both ways
    np.testing.assert_allclose(np.asarray(model_step(*args(decode, packed_state))[0]), np.asarray(unpacked),
                               rtol=tol, atol=tol)
