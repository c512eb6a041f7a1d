"""ModelConfig: the one description of a decoder-only transformer, read from a Hugging Face config.json."""

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    """A config.json Ferry cannot serve; the message names the file and the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face's rope parameters (rope_type and its fields), or None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2 (and Llama's attention_bias): bias on q, k, v
    o_bias: bool = False            # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over each head of q and k before RoPE
    hidden_act: str = "silu"        # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    norm_offset: float = 0.0        # Gemma: RMSNorm multiplies by (1 + w)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None  # the window of the layers whose type is "sliding_attention"
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES; () = every layer full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention): the keys a query at position p sees are those
        after p - window."""
        if not self.layer_types:
            return (0,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in self.layer_types)

    @property
    def query_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] (float32, on the host), after any rope scaling."""
        # float32 throughout, as transformers computes it, so positions agree to the last bit we can.
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        inv_freq = (np.float32(1.0) / (np.float32(self.rope_theta) ** exponents)).astype(np.float32)
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return inv_freq
        if kind == "linear":
            return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
        if kind == "llama3":
            factor = float(scaling["factor"])
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            old_len = float(scaling["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv_freq
            low_wavelen, high_wavelen = old_len / low, old_len / high
            scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = _freeze(d.get("rope_scaling"))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["layer_types"] = tuple(d.get("layer_types") or ())
        return cls(**d)


def _freeze(mapping):
    if not mapping:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in mapping.items()))


def _as_id_list(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def from_hf_config(hf: dict, source: str = "config.json", generation: dict | None = None) -> ModelConfig:
    """Map a Hugging Face config dict (plus generation_config.json, if any) to a ModelConfig."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; Ferry serves {', '.join(SUPPORTED_MODEL_TYPES)}")

    def need(key):
        if key not in hf:
            raise ConfigError(f"{source}: missing required field {key!r} for model_type {model_type!r}")
        return hf[key]

    hidden, num_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = hf.get("head_dim") or hidden // num_heads
    # transformers >= 5 writes rope_parameters (theta inside); older checkpoints rope_theta + rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    for key in ("partial_rotary_factor",):
        if rope.pop(key, 1.0) != 1.0:
            raise ConfigError(f"{source}: {key} is not supported")

    gemma = model_type == "gemma"
    attention_bias = bool(hf.get("attention_bias", False))
    generation = generation or {}
    eos = _as_id_list(generation.get("eos_token_id", hf.get("eos_token_id")))
    bos = generation.get("bos_token_id", hf.get("bos_token_id"))
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    # Gemma's GeGLU is the tanh approximation even where a legacy config says "gelu" (as transformers does).
    if not gemma and act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported for {model_type}")

    sliding_window, layer_types = _attention_layout(hf, model_type, source)
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_freeze(rope),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type in ("llama", "mistral"),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        hidden_act="gelu_tanh" if gemma else "silu",
        scale_embeddings=gemma,
        norm_offset=1.0 if gemma else 0.0,
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        pad_token_id=hf.get("pad_token_id"),
        sliding_window=sliding_window,
        layer_types=layer_types,
    )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {cfg.num_heads} is not a multiple of "
                          f"num_key_value_heads {cfg.num_kv_heads}")
    cfg.rope_inv_freq()  # fail now on an unknown rope type
    return cfg


def _attention_layout(hf: dict, model_type: str, source: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers reads them: `layer_types` where the config has it, else
    each family's rule (Mistral: every layer under `sliding_window`; Qwen2: `use_sliding_window` from layer
    `max_window_layers` on). A window of None, or one not shorter than max_position_embeddings, is no window."""
    num_layers = int(hf.get("num_hidden_layers", 0))
    window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    types = hf.get("layer_types")
    if types is None:
        if model_type == "qwen2":
            first = int(hf.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    types = tuple(types)
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != num_layers:
        raise ConfigError(f"{source}: layer_types must list one of {LAYER_TYPES} for each of the "
                          f"{num_layers} layers (got {len(types)}; unknown: {bad})")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ConfigError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    if window is None or "sliding_attention" not in types or window >= int(hf.get("max_position_embeddings", 2048)):
        return None, ()
    return window, types


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def load_hf_config(model_dir: str) -> tuple[ModelConfig, dict]:
    """(ModelConfig, raw config dict) from a Hugging Face model directory."""
    path = os.path.join(model_dir, "config.json")
    hf = read_json(path)
    gen_path = os.path.join(model_dir, "generation_config.json")
    generation = read_json(gen_path) if os.path.exists(gen_path) else None
    return from_hf_config(hf, source=path, generation=generation), hf
