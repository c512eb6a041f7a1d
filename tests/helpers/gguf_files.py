"""GGUF files written in-test with gguf.GGUFWriter, laid out as llama.cpp's converter (convert_hf_to_gguf.py)
lays them out: its tensor names, Q/K rows permuted for the llama architecture, matrices in one GGML type
and norms (and biases) in F32, the config and the tokenizer as metadata."""

import json
import math
import pathlib

import gguf
import numpy as np
import sentencepiece

# Hugging Face name (after "model.layers.N.") -> llama.cpp name (after "blk.N."), as its converter's
# gguf-py/tensor_mapping.py maps them.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Families whose post_attention_layernorm is a branch-output norm (llama.cpp's post_attention_norm).
_BRANCH_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_ARCH_LAYER_NAMES = {"gemma2": _BRANCH_NORMS, "gemma3": _BRANCH_NORMS, "olmo2": _BRANCH_NORMS}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Hugging Face model_type -> llama.cpp architecture, where they differ.
_ARCH = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}

# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.rest
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    return f"blk.{layer}.{names[rest]}.{suffix}"


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# Byte offsets of the float16 scale fields in one block of each K-quant (ggml-common.h's block_q*_K).
K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_k_quant_blocks(shape: tuple[int, int], kind: gguf.GGMLQuantizationType, rng) -> np.ndarray:
    """Random blocks of a K-quant (the gguf package has no K-quant quantizer): random quants and
    sub-scales, small finite float16 scales."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(shape[0], shape[1] // block, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[kind.name]:
        scales = rng.uniform(0.0005, 0.002, size=data.shape[:2]).astype(np.float16)
        data[..., offset:offset + 2] = scales[..., None].view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(shape[0], -1)


def write_gguf(torch_model, path, matrix_types, tokenizer: dict | None, seed: int = 0) -> pathlib.Path:
    """Write `torch_model` (a transformers model of an architecture llama.cpp converts) as a GGUF at `path`;
    `tokenizer` is a dict of tokenizer.ggml.* metadata (see byte_level_vocab / sentencepiece_vocab), or None for none.
    `matrix_types`: the GGML type of the matrices, or a list of them taken in turn; a K-quant writes
    random blocks (seeded) in place of the model's matrix."""
    matrix_types = list(matrix_types) if isinstance(matrix_types, (list, tuple)) else [matrix_types]
    config = torch_model.config
    arch = _ARCH.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    # Gemma 3: the global layers' RoPE (llama.cpp fixes the local one's base at 10000).
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    extra_tensors = _add_family_fields(writer, config, rope)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    rng = np.random.default_rng(seed)
    state = _expert_stacks({k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp writes no output.weight for a tied head
    for index, (hf_name, weight) in enumerate(state.items()):
        matrix_type = matrix_types[index % len(matrix_types)]
        if arch in ("llama", "granite") and hf_name.endswith("q_proj.weight"):
            weight = permute_rows(weight, config.num_attention_heads)
        if arch in ("llama", "granite") and hf_name.endswith("k_proj.weight"):
            weight = permute_rows(weight, config.num_key_value_heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            weight = weight + np.float32(1.0)  # llama.cpp's norm_shift: it stores Gemma's 1 + w
        if hf_name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(-1)  # llama.cpp stores the [1, hidden] gate as [hidden]
        name = gguf_name(hf_name, arch)
        if weight.ndim == 3 and matrix_type != gguf.GGMLQuantizationType.F32:  # experts [E, out, in]
            writer.add_tensor(name, gguf.quants.quantize(weight, matrix_type), raw_dtype=matrix_type)
        elif weight.ndim == 2 and matrix_type.name in K_QUANT_SCALES:
            writer.add_tensor(name, random_k_quant_blocks(weight.shape, matrix_type, rng), raw_dtype=matrix_type)
        elif weight.ndim == 2 and matrix_type != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(weight, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, weight.astype(np.float32))
    for name, tensor in extra_tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


def _expert_stacks(state: dict) -> dict:
    """transformers' fused expert parameters ("mlp.experts.gate_up_proj" [E, 2I, H], "mlp.experts.down_proj"
    [E, H, I]) as llama.cpp's converter writes them: gate, up and down stacks [E, out, in]."""
    out = {}
    for name, weight in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(weight, 2, axis=1)
            out[f"{name.removesuffix('gate_up_proj')}gate_proj.weight"] = gate
            out[f"{name.removesuffix('gate_up_proj')}up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[f"{name}.weight"] = weight
        else:
            out[name] = weight
    return out


def _add_family_fields(writer: gguf.GGUFWriter, config, rope: dict) -> dict[str, np.ndarray]:
    """The keys llama.cpp's converter writes for the families beyond Llama's; returns the extra tensors it writes
    (Phi-3's LongRoPE factors)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            getattr(writer, f"add_{name}")(getattr(config, name))
    if config.model_type == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if rope.get("rope_type") != "longrope":
        return {}
    original = config.original_max_position_embeddings
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}


def _add_tokenizer(writer: gguf.GGUFWriter, t: dict):
    writer.add_tokenizer_model(t["model"])
    if "pre" in t:
        writer.add_tokenizer_pre(t["pre"])
    writer.add_token_list(t["tokens"])
    writer.add_token_types(t["types"])
    if "scores" in t:
        writer.add_token_scores(t["scores"])
    if "merges" in t:
        writer.add_token_merges(t["merges"])
    writer.add_bos_token_id(t["bos"])
    writer.add_eos_token_id(t["eos"])
    writer.add_add_bos_token(t["add_bos"])
    if "chat_template" in t:
        writer.add_chat_template(t["chat_template"])


def byte_level_vocab(tok_dir, pre: str, add_bos: bool, chat_template: str | None = None) -> dict:
    """tokenizer.ggml.* of a byte-level BPE tokenizer.json (tests/helpers/tokenizer_fixtures.py), as llama.cpp
    converts one: tokens by id, merges as "a b", added special tokens CONTROL."""
    data = json.loads((pathlib.Path(tok_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data["added_tokens"] if t["special"]}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    out = {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges, "add_bos": add_bos,
           "types": [CONTROL if t in special else NORMAL for t in tokens],
           "bos": special["<|begin_of_text|>"], "eos": special["<|eot_id|>"]}
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out


def sentencepiece_vocab(model_file, chat_template: str | None = None) -> dict:
    """tokenizer.ggml.* of a SentencePiece model, as llama.cpp's converter writes a Llama-2 vocabulary."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(CONTROL if sp.is_control(i) else UNKNOWN if sp.is_unknown(i) else BYTE if sp.is_byte(i)
                     else UNUSED if sp.is_unused(i) else NORMAL)
    out = {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "add_bos": True,
           "bos": sp.bos_id(), "eos": sp.eos_id()}
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out
