"""Mixture-of-experts families against transformers (the paged forward pass), with every expert exercised;
the grouped expert computation against a per-token loop; checkpoints and config errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.worker.kv_cache import kv_bytes_per_block
from helpers.hf_models import (
    _COMMON,
    MOE_ARCHS,
    check_greedy_match,
    hf_greedy,
    hf_logits,
    make_hf_model,
    paged_greedy,
    rel_err,
    torch,  # the guarded import: skips this module where torch is missing
    transformers,
)
from models.checkpoints.ferry import save_checkpoint
from models.config import ConfigError, from_hf_config
from models.loading import load_model
from models.moe import route

NUM_NEW = 24


def _routers(torch_model):
    """Each MoE layer's router module (it returns (logits, weights, expert ids))."""
    return [m for name, m in torch_model.named_modules() if name.endswith((".mlp.gate", ".mlp.router"))]


def _record_routing(torch_model):
    """Hooks that count, per layer, the tokens transformers routes to each expert: [layer][expert]."""
    counts = [np.zeros(router.weight.shape[0], np.int64) for router in _routers(torch_model)]

    def hook(i):
        def record(_module, _inputs, output):
            counts[i] += np.bincount(output[2].reshape(-1).numpy(), minlength=len(counts[i]))
        return record

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(_routers(torch_model))]
    return counts, handles


@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def moe_model(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh weights every run; printed on failure
    torch_model = make_hf_model(arch, out, seed=seed)
    return arch, seed, torch_model, load_model(str(out))


def test_moe_matches_transformers_with_every_expert_used(moe_model):
    arch, seed, torch_model, loaded = moe_model
    assert loaded.cfg.num_experts == 8
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, loaded.cfg.vocab_size, size=n).tolist() for n in (5, 17, 40)]
    run = paged_greedy(loaded, prompts, NUM_NEW)
    counts, handles = _record_routing(torch_model)
    try:
        for prompt, logits, tokens in zip(prompts, run.prompt_logits, run.tokens):
            err = rel_err(logits, hf_logits(torch_model, prompt))
            assert err < 1e-4, f"{arch} (seed {seed}) prompt len {len(prompt)}: {err}"
            ref_tokens, ref_logits = hf_greedy(torch_model, prompt, NUM_NEW)
            tie = check_greedy_match(tokens, ref_tokens, ref_logits)
            if tie:
                print(f"{arch} (seed {seed}): accepted tie: {tie}")
    finally:
        for h in handles:
            h.remove()
    # The routing the tokens above took (identical in both, the greedy tokens being): no expert left idle
    for layer, c in enumerate(counts):
        assert (c > 0).all(), f"{arch} (seed {seed}) layer {layer}: experts with no tokens: {np.flatnonzero(c == 0)}"


def test_moe_checkpoint_round_trip(moe_model, tmp_path):
    """save_checkpoint writes each expert apart (as Hugging Face checkpoints do); it loads back bit for bit."""
    _, _, _, loaded = moe_model
    restored = load_model(save_checkpoint(loaded, str(tmp_path / "ckpt")))
    assert restored.cfg == loaded.cfg
    for x, y in zip(jax.tree.leaves(loaded.params()), jax.tree.leaves(restored.params()), strict=True):
        assert x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))


def _edit_config(path, **fields):
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("fields, message", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_moe_config_errors(tmp_path, fields, message):
    make_hf_model("qwen3_moe", tmp_path, seed=0)
    _edit_config(tmp_path / "config.json", **fields)
    with pytest.raises(ConfigError, match=message):
        load_model(str(tmp_path))


def test_gpt_oss_experts_are_deinterleaved(tmp_path):
    """gpt-oss stores each expert's gate and up columns interleaved in one tensor; Ferry's [gate | up] holds the
    even columns, then the odd ones (the parity test covers the rest of gpt-oss)."""
    pytest.importorskip("transformers").GptOssConfig
    from models.checkpoints.tensors import checkpoint_layout  # noqa: PLC0415
    from models.config import ModelConfig  # noqa: PLC0415

    cfg = ModelConfig("gpt_oss", 8, 4, 2, 1, 1, 1, 4)
    fused = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    out = checkpoint_layout("layers.0.mlp.experts.gate_up_proj", fused, cfg)
    np.testing.assert_array_equal(out, np.concatenate([fused[..., 0::2], fused[..., 1::2]], -1))
    assert checkpoint_layout("layers.0.mlp.experts.down_proj", fused, cfg) is fused


def test_gpt_oss_sinks_are_exercised(tmp_path):
    """The same gpt-oss weights with its sinks pushed to -1e4 (no sink: each softmax as a plain one): the logits
    move, so the parity test above covers the sinks (not sinks that never bite)."""
    make_hf_model("gpt_oss", tmp_path, seed=4)
    loaded = load_model(str(tmp_path))
    prompt = np.random.default_rng(4).integers(3, loaded.cfg.vocab_size, size=20).tolist()
    with_sinks = paged_greedy(loaded, [prompt], 1).prompt_logits[0]
    params = loaded.params()
    params["layers"]["self_attn"]["sinks"] = jnp.full_like(params["layers"]["self_attn"]["sinks"], -1e4)
    state = jax.tree.map(lambda leaf: leaf, loaded.state)
    nnx.replace_by_pure_dict(state, params)
    without = paged_greedy(dataclasses.replace(loaded, state=state), [prompt], 1).prompt_logits[0]
    assert rel_err(without, with_sinks) > 1e-3


def test_deepseek_router_matches_transformers():
    """DeepSeek-V3's group-limited sigmoid routing against transformers' own router module, on inputs where the
    group limit and the correction bias change the choice (checked: without them the choice differs)."""
    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, 16)
    with torch.no_grad():
        logits, ref_weights, ref_ids = router(x)
    cfg = from_hf_config({**config.to_dict(), "model_type": "deepseek_v3", "vocab_size": 32})
    bias = jnp.asarray(router.e_score_correction_bias.numpy())
    weights, ids = route(jnp.asarray(logits.numpy()), cfg, bias)
    order = np.argsort(np.asarray(ids), axis=-1)  # transformers' top-k is unsorted: compare as sets with weights
    ref_order = np.argsort(ref_ids.numpy(), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1),
                                  np.take_along_axis(ref_ids.numpy(), ref_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(ref_weights.numpy(), ref_order, -1), rtol=1e-5)
    _, plain = route(jnp.asarray(logits.numpy()), dataclasses.replace(cfg, num_expert_groups=1), None)
    assert (np.sort(np.asarray(plain), -1) != np.sort(np.asarray(ids), -1)).any()


def test_mla_cache_holds_the_latent_row():
    """DeepSeek-V3's KV cache per token and layer: one latent row of kv_lora_rank + qk_rope_head_dim values, where
    full heads would hold heads x (qk_head_dim + v_head_dim)."""
    config = transformers.DeepseekV3Config(**{**_COMMON, **MOE_ARCHS["deepseek_v3"][1]})
    cfg = from_hf_config({**config.to_dict(), "model_type": "deepseek_v3"})
    assert cfg.kv_cache_layout == (1, 1, 32 + 16)
    latent = kv_bytes_per_block(cfg, 8, jnp.float32) // 8
    assert latent == cfg.num_layers * (32 + 16) * 4
    full_heads = cfg.num_layers * cfg.num_heads * ((16 + 16) + 24) * 4
    assert full_heads / latent == pytest.approx(4 * 56 / 48)


def _mxfp4(w: np.ndarray):
    """A float expert tensor [E, K, N] -> MXFP4 (blocks uint8 [E, N, K / 32, 16], scales uint8 [E, N, K / 32]): each
    block of 32 inputs a power of two and e2m1 codes, the nearest value."""
    from models.checkpoints.mxfp4 import FP4_VALUES  # noqa: PLC0415

    x = np.asarray(w, np.float32).transpose(0, 2, 1)
    x = x.reshape(*x.shape[:2], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(x).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = x / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    # contiguous: safetensors writes an array's buffer as it lies
    blocks = np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4), np.uint8)
    return blocks, np.ascontiguousarray(exponent + 127, np.uint8)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 (as the published ones are): Ferry dequantizes them to what
    transformers' own MXFP4 conversion gives, and serves the model as transformers does on those weights."""
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: PLC0415

    torch_model = make_hf_model("gpt_oss", tmp_path, seed=5)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.float32)
        with torch.no_grad():  # transformers' model on the weights the MXFP4 file holds
            torch_model.get_parameter(name).copy_(dequantized)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _edit_config(tmp_path / "config.json", quantization_config={"quant_method": "mxfp4"})
    loaded = load_model(str(tmp_path))
    prompt = np.random.default_rng(5).integers(3, loaded.cfg.vocab_size, size=30).tolist()
    assert rel_err(paged_greedy(loaded, [prompt], 1).prompt_logits[0], hf_logits(torch_model, prompt)) < 1e-4


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret", "pallas_tpu_interpret"])
def test_mla_matches_transformers_through_each_kernel(impl, tmp_path):
    """MLA's latent pages (one head, read as keys and values; on the TPU kernel padded to whole lane tiles) through
    each attention implementation (the native one is the parity test's)."""
    torch_model = make_hf_model("deepseek_v3", tmp_path, seed=2)
    loaded = load_model(str(tmp_path))
    prompts = [np.random.default_rng(2).integers(3, loaded.cfg.vocab_size, size=n).tolist() for n in (5, 17)]
    run = paged_greedy(loaded, prompts, 2, attention_impl=impl)
    for prompt, logits in zip(prompts, run.prompt_logits):
        assert rel_err(logits, hf_logits(torch_model, prompt)) < 1e-4, (impl, len(prompt))
