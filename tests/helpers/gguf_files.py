"""GGUF files written in-test with gguf.GGUFWriter, laid out as llama.cpp's converter (convert_hf_to_gguf.py)
lays them out: its tensor names, Q/K rows permuted for the llama architecture, matrices in one GGML type
and norms (and biases) in F32, the config and the tokenizer as metadata."""

import json
import pathlib

import gguf
import numpy as np
import sentencepiece

# Hugging Face name (after "model.layers.N.") -> llama.cpp name (after "blk.N.").
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


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
    """Write `torch_model` (a transformers llama or qwen2) as a GGUF at `path`; `tokenizer` is a dict of
    tokenizer.ggml.* metadata (see byte_level_vocab / sentencepiece_vocab), or None for none.
    `matrix_types`: the GGML type of the matrices, or a list of them taken in turn; a K-quant writes
    random blocks (seeded) in place of the model's matrix."""
    matrix_types = list(matrix_types) if isinstance(matrix_types, (list, tuple)) else [matrix_types]
    config = torch_model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    if config.rope_parameters.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer)
    rng = np.random.default_rng(seed)
    state = {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp writes no output.weight for a tied head
    for index, (hf_name, weight) in enumerate(state.items()):
        matrix_type = matrix_types[index % len(matrix_types)]
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            weight = permute_rows(weight, config.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            weight = permute_rows(weight, config.num_key_value_heads)
        if weight.ndim == 2 and matrix_type.name in K_QUANT_SCALES:
            writer.add_tensor(gguf_name(hf_name), random_k_quant_blocks(weight.shape, matrix_type, rng),
                              raw_dtype=matrix_type)
        elif weight.ndim == 2 and matrix_type != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(weight, matrix_type)
            writer.add_tensor(gguf_name(hf_name), data, raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(hf_name), weight.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


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
