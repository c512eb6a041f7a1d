"""Small random Hugging Face checkpoints of every architecture Ferry serves (the paged greedy driver
they are compared through is tests/helpers/paged_driver.py, re-exported here).

The reference is transformers (PyTorch, CPU, float32). Models are built from a seeded config and
written with `save_pretrained`, exactly as a user's checkpoint directory would look.
"""

import shutil

import jax
import numpy as np
import pytest

from helpers.paged_driver import PagedRun, paged_greedy, rel_err  # noqa: F401  (re-exported for the tests)
from models.mesh import split_columns
from models.transformer import FUSED_PROJECTIONS, fused_projection_widths

# The jax-0.11 CI environment (Python 3.12, `make test-jax011`) has no PyTorch: there, every test
# that compares against transformers is skipped here, by name, and runs in the main environment.
TORCH_SKIP_REASON = ("needs torch + transformers (the reference models); not installed in this "
                     "environment (the torch-free jax-0.11 CI env); these tests run in `make test`")
torch = pytest.importorskip("torch", reason=TORCH_SKIP_REASON)
transformers = pytest.importorskip("transformers", reason=TORCH_SKIP_REASON)

_COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, overrides). Each exercises something the others do not.
ARCHS = {
    "llama2": (transformers.LlamaConfig, dict(num_key_value_heads=4)),  # MHA, untied
    "llama3": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),  # q/k/v bias, tied
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),  # q/k norm, head_dim != hidden / heads
    "gemma": (transformers.GemmaConfig, dict(num_key_value_heads=1, head_dim=32)),  # MQA, GeGLU, (1+w) norm
    # Windows of 8: the 17- and 40-token prompts cross them.
    "mistral_window": (transformers.MistralConfig, dict(sliding_window=8)),
    "qwen2_window": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # sandwich norms, soft-caps, query_pre_attn_scalar, sliding (layer 0) then global (layer 1), attention bias
    "gemma2": (transformers.Gemma2Config, dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                               attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                                               attention_bias=True)),
    # q/k norms; local RoPE (theta 10k, no scaling) on sliding layers, linear-scaled global RoPE on full ones
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # Phi-3: fused qkv/gate_up checkpoint tensors, LongRoPE. Each sequence stays on one side of original_max
    # (transformers' generate recomputes a sequence that crosses it, Ferry does not: models/transformer.rope_tables):
    # here every prompt passes it (2), the long factors throughout; sliding window 8.
    "phi3": (transformers.Phi3Config, dict(
        original_max_position_embeddings=2, sliding_window=8, rope_scaling=dict(
            type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0, 24.0]))),
    # Phi-4-mini: partial rotary 0.75 (12 of 16 features rotate), tied head; no sequence reaches original_max (128),
    # the short factors and the attention factor of max/original = 2
    "phi4_mini": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=128, tie_word_embeddings=True,
        rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                          long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 13.0]))),
    "olmo2": (transformers.Olmo2Config, dict()),  # branch-output norms, q/k norms over all heads
    "granite": (transformers.GraniteConfig, dict(embedding_multiplier=6.0, attention_multiplier=0.09,
                                                 residual_multiplier=0.3, logits_scaling=4.0)),
    "llama_yarn": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=16,
        beta_slow=1))),
    # dynamic NTK: the base grows once a sequence passes max_position_embeddings (24 here; the model serves 4x that)
    "llama_dynamic": (transformers.LlamaConfig, dict(max_position_embeddings=24, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=4.0))),
}


# Mixture-of-experts families (tests/models/test_moe.py, tests/engine/test_moe_parallel.py): 8 experts of 32
# units, so that with these prompts every expert of every layer receives tokens (the tests check it).
MOE_ARCHS = {
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    # q/k norms, renormalised top-k
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    norm_topk_prob=True, head_dim=32)),
    # q/k/v biases, top-4 not renormalised, the gated shared expert, tied head
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                    tie_word_embeddings=True)),
    # attention sinks, sliding (window 8) then full layers, YaRN, q/k/v/o biases, a router bias, expert biases,
    # the clamped SwiGLU (limit 1.5, so that the clamps bite), top-k of the logits then softmax
    "gpt_oss": (transformers.GptOssConfig, dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
        swiglu_limit=1.5, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False, original_max_position_embeddings=64))),
    # latent attention (q through its low-rank pair, interleaved RoPE), sigmoid routing over 4 groups of which 2
    # are eligible, the correction bias, routed_scaling_factor, 2 shared experts, a dense first layer
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3, q_lora_rank=48,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, num_key_value_heads=4)),
}


def layer_projection(layer: dict, cfg, module: str, proj: str) -> np.ndarray:
    """Hugging Face projection `module.proj`'s kernel [in, out] from one layer's params: the model's own
    (o_proj, down_proj) or its slice of the fused q/k/v or gate/up kernel (FUSED_PROJECTIONS)."""
    for fused_module, fused, widths in fused_projection_widths(cfg):
        parts = FUSED_PROJECTIONS[f"{fused_module}.{fused}"]
        if f"{module}.{proj}" in parts:
            kernel = layer[fused_module][fused]["kernel"]
            return np.asarray(split_columns(kernel, widths, 1)[parts.index(f"{module}.{proj}")])
    return np.asarray(layer[module][proj]["kernel"])


def make_hf_model(arch: str, out_dir, seed: int = 0, dtype=torch.float32, **overrides):
    """Build a seeded random model of `arch`, save it to `out_dir`, and return the torch model."""
    config_cls, arch_overrides = {**ARCHS, **MOE_ARCHS}[arch]
    config = config_cls(**{**_COMMON, **arch_overrides, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    # Every norm weight and bias moved off its init (ones, Gemma's zeros, zero biases): a parameter Ferry ignored
    # would then change the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias", ".sinks")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router: a buffer, saved with the weights
                b.add_(torch.randn_like(b) * 0.05)
    model.generation_config.eos_token_id = None  # greedy runs the full length
    model.save_pretrained(out_dir)
    return model


def fresh_rope(model):
    """Forget the longest sequence a dynamic-NTK rotary embedding has seen: transformers keeps it across calls
    (and keeps the frequencies it grew to until a call shorter than max_position_embeddings resets them), where
    each reference call here stands for a new request, as each sequence is to Ferry."""
    for module in model.modules():
        if hasattr(module, "max_seq_len_cached") and hasattr(module, "original_inv_freq"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len
    return model


def hf_greedy(model, prompt: list[int], num_new: int):
    """(tokens, per-step logits [num_new, vocab]) from transformers' own generate."""
    fresh_rope(model)
    ids = torch.tensor([prompt])
    # An explicit mask: a prompt may hold the pad id (e.g. a second turn that resends a generated answer),
    # and generate would otherwise infer the mask from it and hide those tokens.
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack(out.logits, dim=1)[0].float().numpy()


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    fresh_rope(model)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def check_greedy_match(ours: list[int], ref: list[int], ref_logits: np.ndarray, tie_tol=1e-4) -> str | None:
    """Token-identical, or diverging only where the reference's top two logits tie (within tie_tol).
    Returns a report of an accepted tie, None if identical; raises AssertionError otherwise."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(ref_logits[i])[-2:]
            gap = float(top2[1] - top2[0])
            assert gap <= tie_tol, (f"greedy divergence at step {i}: ferry {a}, transformers {b}, reference "
                                    f"top-two gap {gap:.3g} > {tie_tol} (not a tie)\nours {ours}\nref  {ref}")
            return f"tie at step {i}: ferry {a} vs transformers {b} (reference top-two gap {gap:.2e})"
    assert len(ours) == len(ref)
    return None


def random_llama_checkpoint(tmp_path_factory):
    """(seed, torch model, Ferry's LoadedModel) of a random llama3 checkpoint with a fresh seed (printed by the
    tests that use it on failure)."""
    from models.loading import load_model  # noqa: PLC0415

    out = tmp_path_factory.mktemp("llama")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    torch_model = make_hf_model("llama3", out, seed=seed)
    return seed, torch_model, load_model(str(out))


def make_text_model(tmp_path_factory, seed: int, chat_template: str | None = None, **overrides):
    """(model dir, torch model): a random llama whose vocabulary is the byte-level BPE test tokenizer's
    (tests/helpers/tokenizer_fixtures.py), with the tokenizer files beside the weights as in a real checkpoint."""
    from helpers.tokenizer_fixtures import write_byte_level_bpe_dir  # noqa: PLC0415 (only the text tests need it)
    from models.tokenizers.load import load_tokenizer

    tok_dir = write_byte_level_bpe_dir(tmp_path_factory.mktemp("tok"), chat_template=chat_template)
    vocab = load_tokenizer(str(tok_dir)).vocab_size
    out = tmp_path_factory.mktemp("model")
    torch_model = make_hf_model("llama3", out, seed=seed, vocab_size=vocab, bos_token_id=0, eos_token_id=2,
                                pad_token_id=1, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    return str(out), torch_model


def load_weights_into(torch_model, loaded) -> None:
    """Copy a Ferry model's weights into the torch model of the same architecture, quantized ones dequantized
    (models/quantization.py): transformers on exactly the weights Ferry serves (a quantized embedding is held
    as the tied head's [D, V] kernel). The reference for quantized models."""
    from models.checkpoints.tensors import hf_to_ferry_name, per_layer_tensors, unfuse_projections  # noqa: PLC0415
    from models.quantization import is_quantized  # noqa: PLC0415

    params = jax.tree.map(lambda a: a.dequantize() if is_quantized(a) else a, loaded.params(), is_leaf=is_quantized)
    tensors = unfuse_projections(per_layer_tensors(params), loaded.cfg)
    state = torch_model.state_dict()
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            ferry, transpose = hf_to_ferry_name(name)
            if name == "lm_head.weight" and loaded.cfg.tie_word_embeddings:
                continue
            value = np.array(tensors[ferry], np.float32)
            if ferry == "embed_tokens.embedding" and is_quantized(loaded.params()["embed_tokens"]["embedding"]):
                value = value.T
            state[name].copy_(torch.from_numpy(np.ascontiguousarray(value.T if transpose else value)))
            assert tuple(param.shape) == tuple(state[name].shape)
