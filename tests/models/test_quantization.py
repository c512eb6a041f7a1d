"""Weight-only quantized linears (models/quantization.py): the format's arithmetic, combining kernels of mixed
formats, and quantized models against transformers on the same weights dequantized."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.hf_models import check_greedy_match, hf_greedy, hf_logits, load_weights_into, make_hf_model, rel_err
from helpers.paged_driver import paged_greedy
from models.loading import load_model, quantize_model, unstack_layers
from models.quantization import (
    QuantizedWeight,
    concatenate,
    quantize,
    quantized_embedding,
    quantized_matmul,
    split,
    stack,
    weight_bytes,
)

METHODS = [("int8", None), ("int4", 32), ("int4", 64), ("fp8", None)]


def _rng():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return seed, np.random.default_rng(seed)


@pytest.mark.parametrize("method,group", METHODS)
def test_quantize_rounds_each_weight_to_its_nearest_level(method, group):
    """Every weight within half a step of its dequantized value (fp8: within e4m3's relative spacing), the
    scales per layer of a stack, int4's groups along K."""
    seed, rng = _rng()
    w = rng.normal(size=(3, 192, 40)).astype(np.float32) * rng.uniform(0.1, 3, size=(3, 1, 40)).astype(np.float32)
    q = quantize(w, method, group, stacked=True)
    err = np.abs(np.asarray(q.dequantize()) - w)
    step = np.repeat(np.asarray(q.scales), q.group_size, axis=-2)
    if method == "fp8":
        assert q.scales.shape == (3, 1, 40) and q.values.dtype == jnp.float8_e4m3fn
        assert np.all(err <= np.abs(w) * 2**-4 + step * 2**-9), seed  # 3 mantissa bits, subnormals
    else:
        assert q.group_size == (192 if method == "int8" else group)
        assert np.all(err <= step * 0.5 * (1 + 1e-4)), seed  # half a step, and float32 rounding
    # one stack quantized, or each layer alone: the same (scales per layer)
    alone = quantize(w[1], method, group)
    assert np.array_equal(np.asarray(alone.dequantize()), np.asarray(q.dequantize())[1])


def test_int4_groups_fall_back_to_a_divisor_of_k():
    w = np.random.default_rng(0).normal(size=(576, 8)).astype(np.float32)
    assert quantize(w, "int4", 128).group_size == 64  # 576 = 9 x 64
    assert quantize(w[:200], "int4", 128).group_size == 200  # no group of 16 or more divides 200: one group


def _format(rng, dtype, group, offsets, k=64, n=12):
    lo, hi = {jnp.int8: (-128, 128), jnp.int4: (-8, 8), jnp.uint4: (0, 16)}[dtype]
    values = jnp.asarray(rng.integers(lo, hi, size=(k, n)), dtype)
    scales = rng.uniform(0.01, 0.1, size=(k // group, n)).astype(np.float32)
    return QuantizedWeight(values, scales, rng.normal(size=scales.shape).astype(np.float32) if offsets else None)


def test_mixed_formats_combine_exactly():
    """A Q4_K part (uint4 g32, offsets) beside a Q6_K one (int8 g16) and a Q4_0 one (int4 g32): concatenated
    and stacked into one format (int8, g16, offsets) whose weights are the parts' own, bit for bit; split back."""
    seed, rng = _rng()
    parts = [_format(rng, jnp.uint4, 32, True), _format(rng, jnp.int8, 16, False), _format(rng, jnp.int4, 32, False)]
    whole = concatenate(parts)
    assert whole.values.dtype == jnp.int8 and whole.group_size == 16 and whole.offsets is not None
    want = np.concatenate([np.asarray(p.dequantize()) for p in parts], axis=-1)
    assert np.array_equal(np.asarray(whole.dequantize()), want), seed
    for got, part in zip(split(whole, [12, 24]), parts):
        assert np.array_equal(np.asarray(got.dequantize()), np.asarray(part.dequantize()))
    stacked = stack(parts)
    assert stacked.values.shape == (3, 64, 12)
    assert np.array_equal(np.asarray(stacked.dequantize())[1], np.asarray(parts[1].dequantize()))
    float_and_quantized = concatenate([np.ones((64, 4), np.float32), parts[0]])
    assert float_and_quantized.shape == (64, 16) and not isinstance(float_and_quantized, QuantizedWeight)


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("group", [16, 64])
def test_matmul_and_embedding_read_the_dequantized_weights(offsets, group):
    """quantized_matmul is x @ dequantize(w) in both its forms (few rows: per-group partial sums; many: the
    weights dequantized); quantized_embedding gathers the dequantized columns of a [D, V] table."""
    seed, rng = _rng()
    for g in (group, 64):  # 64 = K: one group, the per-channel form
        w = _format(rng, jnp.int8, g, offsets)
        for rows in (1, 3, 40):
            x = jnp.asarray(rng.normal(size=(rows, 64)), jnp.float32)
            want = np.asarray(x) @ np.asarray(w.dequantize(), np.float64)
            assert rel_err(quantized_matmul(x, w), want) < 1e-5, seed
        ids = jnp.asarray([[3, 0], [11, 3]])
        rows = quantized_embedding(w, ids)
        assert rows.shape == (2, 2, 64)
        assert np.array_equal(np.asarray(rows), np.asarray(w.dequantize()).T[np.asarray(ids)])


def _quantized_and_reference(tmp_path, arch, method, group, seed):
    torch_model = make_hf_model(arch, tmp_path / arch, seed=seed)
    model = quantize_model(load_model(str(tmp_path / arch)), method, group)
    load_weights_into(torch_model, model)
    return model, torch_model


@pytest.mark.parametrize("method,group", METHODS)
@pytest.mark.parametrize("arch", ["llama3", "qwen2"])  # untied; tied head with q/k/v biases
def test_quantized_model_matches_transformers_on_its_dequantized_weights(tmp_path, arch, method, group):
    """Ferry's quantized model (scanned and unrolled layers) against transformers with the same weights
    dequantized: prompt logits within float32 rounding, greedy tokens identical (or a reference tie). The
    layers' quantized kernels take about 1/4 (8-bit) or 1/6 (4-bit, with scales and offsets) of float32's bytes."""
    seed, rng = _rng()
    model, torch_model = _quantized_and_reference(tmp_path, arch, method, group, seed)
    float_bytes = weight_bytes(load_model(str(tmp_path / arch)).params()["layers"])
    assert weight_bytes(model.params()["layers"]) < float_bytes * (0.3 if method != "int4" else 0.2), seed
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (5, 23)]
    for form in (model, unstack_layers(model)):
        run = paged_greedy(form, prompts, 8)
        for i, prompt in enumerate(prompts):
            ref_tokens, ref_logits = hf_greedy(torch_model, prompt, 8)
            check_greedy_match(run.tokens[i], ref_tokens, ref_logits)
            assert rel_err(run.prompt_logits[i], hf_logits(torch_model, prompt)) < 1e-4, seed


def test_quantizing_twice_and_bad_methods_are_errors(tmp_path):
    make_hf_model("llama3", tmp_path / "m", seed=0)
    model = quantize_model(load_model(str(tmp_path / "m")), "int8")
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="int8, int4, fp8|one of"):
        quantize(np.ones((16, 4), np.float32), "int3")
    assert jax.tree.leaves(model.params()["layers"]["mlp"]["down_proj"]["kernel"])[0].dtype == jnp.int8


def test_unrolled_layers_quantize_per_channel_as_the_stack_does():
    """quantize_kernels on a model with one module per layer (2-D kernels): int8's scales per output channel,
    as for the scanned stack's layers (a 2-D kernel taken for a stack got a scale per weight)."""
    from flax import nnx  # noqa: PLC0415

    from models.config import ModelConfig  # noqa: PLC0415
    from models.transformer import Transformer, quantize_kernels  # noqa: PLC0415

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    for scan in (True, False):
        graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), scan=scan))
        params = nnx.to_pure_dict(quantize_kernels(graphdef, state, "int8"))
        down = params["layers"]["mlp"]["down_proj"]["kernel"] if scan else params["layers"][1]["mlp"]["down_proj"][
            "kernel"]
        assert down.scales.shape == ((2, 1, 32) if scan else (1, 32)), (scan, down.scales.shape)
