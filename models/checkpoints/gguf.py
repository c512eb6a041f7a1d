"""GGUF checkpoints (llama.cpp's single-file format): weights and config, read with the `gguf` package.

A GGUF holds llama.cpp-named tensors (`token_embd`, `blk.N.attn_q`, ...), possibly quantized, and the
config and tokenizer as metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...). Here the matrices of
the common block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are repacked, not dequantized, into
QuantizedWeights that give gguf.quants' float32 weights exactly (models/checkpoints/gguf_blocks.py); the other
tensors are dequantized (gguf.quants: F32, F16, BF16, Q2_K, Q3_K, the IQ types); all are renamed to Hugging
Face names with llama.cpp's Q/K row permutation undone, and the metadata becomes a Hugging Face config dict; both
then take the same route as a safetensors checkpoint (models/checkpoints/tensors.Checkpoint, read by
models/loading.py). The tokenizer is built in models/tokenizers/gguf.py.

    load_model("SmolLM2-135M-Instruct.Q4_1.gguf")   # or a directory holding one .gguf file
"""

import concurrent.futures
import dataclasses
import glob
import logging
import math
import os
import struct
from typing import Any

import jax
import numpy as np

from models.checkpoints import gguf_blocks
from models.checkpoints.tensors import Checkpoint
from models.config import ConfigError, from_hf_config
from models.quantization import QuantizedWeight

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# general.architecture -> Ferry's model_type. llama.cpp writes Mistral and SmolLM as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
                 "gemma3": "gemma3_text", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite",
                 "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # "llama" with experts: Mixtral (hf_config)
# The architectures whose Q/K rows llama.cpp's converter permutes for its interleaved RoPE (LlamaModel.permute).
_PERMUTED_QK = ("llama", "granite")
# Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores 1 + w (its norm_shift), read back as w.
_NORM_SHIFTED = ("gemma", "gemma2", "gemma3")
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's every-nth-layer-global rule where no pattern is stored

# llama.cpp tensor names (gguf.constants.TENSOR_NAMES) -> Hugging Face names (the ".weight" / ".bias" suffix is kept).
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, the experts' [E, out, in] stacks (read as one tensor per expert), Qwen2-MoE's
    # shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Where an architecture's tensor means something else: Gemma 2/3's ffn_norm is the pre-MLP norm beside the
# post-attention one; Phi-3's ffn_up holds gate and up fused.
_ARCH_LAYER_TENSORS = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
# Phi-3's LongRoPE factors: stored as tensors, read into the config.
_ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


def find_gguf_file(path: str) -> str | None:
    """`path` itself if it is a .gguf file; the one .gguf in directory `path`; None if there is none."""
    if os.path.isfile(path):
        return path if path.endswith(GGUF_SUFFIX) else None
    files = sorted(glob.glob(os.path.join(path, "*" + GGUF_SUFFIX)))
    if len(files) > 1:
        names = ", ".join(os.path.basename(f) for f in files)
        raise FileNotFoundError(f"{path}: several GGUF files ({names}); pass the path of the one to load")
    return files[0] if files else None


@dataclasses.dataclass(slots=True)
class GGUFTensor:
    name: str                  # llama.cpp's name, e.g. "blk.0.attn_q.weight"
    kind: Any                  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]     # numpy (row-major) order: [rows, cols] for a matrix
    data: np.ndarray           # uint8 [*shape[:-1], bytes per row], a view of the memory-mapped file


@dataclasses.dataclass(slots=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]   # every key/value: strings decoded, arrays as lists
    tensors: list[GGUFTensor]


def read_gguf(path: str) -> GGUFFile:
    """The metadata and (memory-mapped, not yet read) tensors of a GGUF file; ConfigError if it is not one.

    The format (magic, version, counts, key/values, tensor infos, aligned data) is parsed here rather
    than by gguf.GGUFReader, which builds a numpy view per array element: tens of seconds for a real
    vocabulary and its merges. The gguf package still supplies the type tables and the dequantization."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415

    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(data), path)
    if bytes(cursor.take(4)) != b"GGUF":
        raise ConfigError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cursor.scalar(_U32)
    if version not in (2, 3):
        raise ConfigError(f"{path}: GGUF version {version} is not supported (2, 3)")
    num_tensors, num_keys = cursor.scalar(_U64), cursor.scalar(_U64)
    meta = {}
    for _ in range(num_keys):
        key = cursor.string()
        meta[key] = cursor.value(cursor.scalar(_U32))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.scalar(_U64) for _ in range(cursor.scalar(_U32))]
        kind, offset = cursor.scalar(_U32), cursor.scalar(_U64)
        infos.append((name, dims, kind, offset))
    alignment = int(meta.get("general.alignment", 32))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            kind = GGMLQuantizationType(kind)
        except ValueError:
            raise ConfigError(f"{path}: tensor {name!r} has unknown GGML type {kind}") from None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))  # GGUF lists dimensions innermost first
        if shape[-1] % block:
            raise ConfigError(f"{path}: tensor {name!r} of type {kind.name} has rows of {shape[-1]} elements, "
                              f"not a multiple of its {block}-element blocks")
        row_bytes = shape[-1] // block * block_bytes
        count = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        begin = start + offset
        if begin + count > data.size:
            raise ConfigError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        tensors.append(GGUFTensor(name, kind, shape, data[begin:begin + count].reshape(*shape[:-1], row_bytes)))
    return GGUFFile(path, meta, tensors)


# GGUF value type ids (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_U32, _U64, _STRING, _ARRAY = 4, 10, 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclasses.dataclass(slots=True)
class _Cursor:
    """Reads little-endian GGUF values off a memory-mapped file (struct on a memoryview: no copies)."""

    buffer: memoryview
    path: str
    offset: int = 0

    def take(self, n: int) -> memoryview:
        if self.offset + n > len(self.buffer):
            raise ConfigError(f"{self.path}: GGUF header ends early (truncated file?)")
        chunk = self.buffer[self.offset:self.offset + n]
        self.offset += n
        return chunk

    def scalar(self, kind: int):
        fmt = "<" + _SCALARS[kind]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return str(self.take(self.scalar(_U64)), "utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar(_U32), self.scalar(_U64)
            if item_kind in _SCALARS:  # one read for the whole array
                fmt = f"<{count}{_SCALARS[item_kind]}"
                return list(struct.unpack(fmt, self.take(struct.calcsize(fmt))))
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ConfigError(f"{self.path}: unknown GGUF value type {kind}")
        return self.scalar(kind)


# ---------------------------------------------------------------- config

def hf_config(meta: dict, tensor_names: set[str], source: str, rope_factors: dict | None = None) -> dict:
    """A Hugging Face config dict from GGUF metadata (the keys llama.cpp's converter writes) and `rope_factors`
    (Phi-3's LongRoPE factor tensors, by _ROPE_FACTOR_TENSORS name)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: general.architecture {arch!r} is not supported; Ferry loads GGUF "
                          f"architectures {', '.join(ARCHITECTURES)}")

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise ConfigError(f"{source}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError(f"{source}: rope_freqs.weight (per-frequency rope factors, e.g. Llama 3.1's "
                          f"scaling) is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ()) or None
    hf = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        # llama.cpp writes no output.weight when the head is the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch != "qwen2",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(eos_token_ids(meta)),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if vocab is None:
        hf.pop("vocab_size")  # from_hf_config names the missing field
    if rotary_dim != head_dim:
        hf["partial_rotary_factor"] = rotary_dim / head_dim  # from_hf_config says where it is not supported
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling != "none":
        raise ConfigError(f"{source}: {arch}.rope.scaling.type {scaling!r} is not supported (none, linear)")
    if rope_factors:
        hf["rope_scaling"] = _longrope(meta, arch, hf, rope_factors, source)
    hf.update(_family_fields(meta, arch, hf))
    hf.update(_expert_fields(meta, arch, hf, source))
    return hf


def _expert_fields(meta: dict, arch: str, hf: dict, source: str) -> dict:
    """A mixture of experts' config from llama.cpp's expert keys: Mixtral (written as "llama" with experts; its
    feed_forward_length is the experts'), Qwen2-MoE and Qwen3-MoE (the experts' own feed-forward length; llama.cpp
    renormalises Qwen3-MoE's top-k weights, as its released configs set norm_topk_prob)."""
    count = meta.get(f"{arch}.expert_count")
    if not count:
        return {}
    used = meta.get(f"{arch}.expert_used_count")
    if used is None:
        raise ConfigError(f"{source}: missing GGUF metadata {arch}.expert_used_count")
    out = {"num_experts_per_tok": int(used)}
    if arch == "llama":
        return {**out, "model_type": "mixtral", "num_local_experts": int(count)}
    out |= {"num_experts": int(count), "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"]),
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(meta[f"{arch}.expert_shared_feed_forward_length"])
    return out


def _longrope(meta: dict, arch: str, hf: dict, rope_factors: dict, source: str) -> dict:
    """Phi-3's LongRoPE from its factor tensors and llama.cpp's rope.scaling keys."""
    if set(rope_factors) != set(_ROPE_FACTOR_TENSORS.values()):
        raise ConfigError(f"{source}: LongRoPE needs both {', '.join(_ROPE_FACTOR_TENSORS)}")
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", hf["max_position_embeddings"]))
    rope = {"rope_type": "longrope", "original_max_position_embeddings": original,
            **{key: [float(f) for f in factors] for key, factors in rope_factors.items()}}
    # llama.cpp stores the attention factor it derived (float32); transformers derives the same from the lengths.
    stored = meta.get(f"{arch}.rope.scaling.attn_factor")
    scale = hf["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    if stored is not None and abs(stored - derived) > 1e-6:
        rope["attention_factor"] = float(stored)
    return rope


def _family_fields(meta: dict, arch: str, hf: dict) -> dict:
    """The config fields of the families beyond Llama's, from the keys llama.cpp's converter writes for them."""
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    out = {}
    if key("attention.sliding_window") in meta and meta[key("attention.sliding_window")]:
        out["sliding_window"] = int(meta[key("attention.sliding_window")])
        pattern = meta.get(key("attention.sliding_window_pattern"), _GEMMA_SWA_PATTERN.get(arch))
        if isinstance(pattern, list):  # per layer, true for a sliding one
            out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is not None:
            out["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                  for i in range(int(hf["num_hidden_layers"]))]
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.get(key(name)):
            out[name] = float(meta[key(name)])
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's query scale: its attention.scale where written, else 1/sqrt(head_dim), but for the 27B models
        # (46 layers: Gemma 2; 62: Gemma 3) 1/sqrt(hidden / heads): transformers' query_pre_attn_scalar.
        big = int(hf["num_hidden_layers"]) == {"gemma2": 46, "gemma3": 62}[arch]
        scalar = hf["hidden_size"] / hf["num_attention_heads"] if big else hf["head_dim"]
        out["query_pre_attn_scalar"] = meta[key("attention.scale")] ** -2 if key("attention.scale") in meta else scalar
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(meta.get(key("rope.freq_base_swa"), 10000.0))
    if arch == "granite":
        out.update(embedding_multiplier=float(meta.get(key("embedding_scale"), 1.0)),
                   residual_multiplier=float(meta.get(key("residual_scale"), 1.0)),
                   attention_multiplier=float(meta.get(key("attention.scale"), 1.0)),
                   logits_scaling=float(meta.get(key("logit_scale"), 1.0)))
    return out


def eos_token_ids(meta: dict) -> tuple[int, ...]:
    """EOS, then end-of-turn if the file names a different one (llama.cpp stops on both)."""
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


# ---------------------------------------------------------------- tensors

def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (architecture `arch`'s meaning); None for
    an unknown name."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    layer_tensors = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
    if len(parts) == 1 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: its converter interleaves each head's two rotary halves
    (reshape(heads, 2, d/2).swapaxes(1, 2)) for its own RoPE kernel; Ferry rotates halves, as HF does."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def checkpoint_tensors(gguf: GGUFFile, hf: dict, dequantize: bool = False):
    """(file, HF name, tensor [torch layout]) for every weight tensor, in file order: a Linear's (or the
    embedding's) matrix of a type gguf_blocks repacks as a QuantizedWeight (the transpose of Ferry's [in, out]
    kernel: `qw.T`), unless `dequantize`; every other tensor a float32 numpy array (gguf.quants).

    numpy lets go of the GIL: tensors are read on a thread per core."""
    arch = gguf.metadata["general.architecture"]
    weights = [t for t in gguf.tensors if t.name not in _ROPE_FACTOR_TENSORS]
    for tensor in weights:
        if hf_tensor_name(tensor.name, arch) is None:
            raise ConfigError(f"{gguf.path}: tensor {tensor.name!r} has no place in a {hf['model_type']} model")
    _log_dequantized(gguf, arch, dequantize)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for tensors in pool.map(lambda tensor: _read_tensor(gguf.path, tensor, hf, arch, dequantize), weights):
            yield from tensors


def _packable(tensor: GGUFTensor, arch: str) -> bool:
    """A matrix the model may hold quantized (a projection, the LM head, the embedding) of a repacked type."""
    name = hf_tensor_name(tensor.name, arch) or ""
    kernel = name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))
    return kernel and tensor.kind.name in gguf_blocks.REPACKED and len(tensor.shape) == 2


def _log_dequantized(gguf: GGUFFile, arch: str, dequantize: bool):
    """One log line for the quantized matrices read as float32: types not repacked, rows blocks do not divide."""
    if dequantize:
        return
    floats = ("F32", "F16", "BF16", "F64")
    kinds = sorted({f"{t.kind.name} {list(t.shape)}" if _packable(t, arch) else t.kind.name
                    for t in gguf.tensors if len(t.shape) == 2 and t.kind.name not in floats
                    and not (_packable(t, arch) and gguf_blocks.can_repack(t.kind.name, t.shape))})
    if kinds:
        logger.info("%s: quantized tensors of %s are dequantized to float32 (Ferry repacks %s)", gguf.path,
                    ", ".join(kinds), ", ".join(gguf_blocks.REPACKED))


def _dequantized(path: str, tensor: GGUFTensor) -> np.ndarray:
    from gguf.quants import dequantize  # noqa: PLC0415

    try:
        return dequantize(tensor.data, tensor.kind).reshape(tensor.shape)
    except NotImplementedError as e:
        raise ConfigError(f"{path}: tensor {tensor.name!r}: {e}") from None


def _read_tensor(path: str, tensor: GGUFTensor, hf: dict, arch: str, dequantize: bool):
    if not dequantize and _packable(tensor, arch) and gguf_blocks.can_repack(tensor.kind.name, tensor.shape):
        weight = QuantizedWeight(*gguf_blocks.repack(tensor.data, tensor.kind.name, tensor.shape))
    else:
        weight = _dequantized(path, tensor)
    role = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    if arch in _PERMUTED_QK and role in heads:  # rows (outputs): values, scales and offsets alike
        weight = jax.tree.map(lambda rows: unpermute_rows(rows, heads[role]), weight)
    if arch in _NORM_SHIFTED and tensor.name.endswith("norm.weight"):
        weight = weight - np.float32(1.0)
    name = hf_tensor_name(tensor.name, arch)
    if role and role.endswith("_exps"):  # [E, out, in]: each expert's matrix, as Hugging Face names them
        module, _, proj = name.rpartition(".experts.")
        return [(path, f"{module}.experts.{e}.{proj}", expert) for e, expert in enumerate(weight)]
    if role == "ffn_gate_inp_shexp":  # [hidden] as llama.cpp stores it; transformers' Linear(hidden, 1)
        weight = weight.reshape(1, -1)
    return [(path, name, weight)]


def default_dtype(gguf: GGUFFile, dequantize: bool = True) -> str:
    """The checkpoint's own float dtype where it has one (every float matrix F16, or every one BF16; with
    `dequantize`, every matrix), else float32."""
    arch = gguf.metadata.get("general.architecture")
    kinds = {t.kind.name for t in gguf.tensors
             if len(t.shape) > 1 and (dequantize or not (_packable(t, arch) and
                                                          gguf_blocks.can_repack(t.kind.name, t.shape)))}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")


def read_checkpoint(path: str, dequantize: bool = False) -> Checkpoint:
    """A .gguf file's config and tensors: its Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K matrices kept
    packed (QuantizedWeight), the rest float (all of it with `dequantize`): the float tensors in the file's own
    dtype unless the caller names one (default_dtype)."""
    gguf = read_gguf(path)
    rope_factors = {_ROPE_FACTOR_TENSORS[t.name]: _dequantized(path, t).reshape(-1)
                    for t in gguf.tensors if t.name in _ROPE_FACTOR_TENSORS}
    hf = hf_config(gguf.metadata, {t.name for t in gguf.tensors}, path, rope_factors)
    cfg = from_hf_config(hf, source=path)
    return Checkpoint(cfg, default_dtype(gguf, dequantize), checkpoint_tensors(gguf, hf, dequantize),
                      cfg.max_context_len, path, f"{path}'s metadata")
