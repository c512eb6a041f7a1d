"""ModelConfig: the one description of a decoder-only transformer, read from a Hugging Face config.json."""

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3", "phi3",
                         "olmo2", "granite", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
# Mixture-of-experts families (models/moe.py): their MLPs are sparse MoE blocks (DeepSeek: after the first
# first_k_dense_replace layers).
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
LAYER_TYPES = ("full_attention", "sliding_attention")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# Decoder layer norm layouts: "pre" (Llama: input_layernorm before attention, post_attention_layernorm before the
# MLP), "sandwich" (Gemma 2/3: those two plus post_attention_layernorm on the attention output and
# post_feedforward_layernorm on the MLP output, each before its residual add, the pre-MLP norm being
# pre_feedforward_layernorm), "post" (OLMo 2: no pre-norms, post_attention_layernorm and post_feedforward_layernorm
# on the branch outputs).
NORM_LAYOUTS = {"gemma2": "sandwich", "gemma3_text": "sandwich", "olmo2": "post"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# The families whose transformers modeling rotates only the first partial_rotary_factor of each head.
PARTIAL_ROTARY_TYPES = ("phi3",)


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
    qk_norm: bool = False           # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    qk_norm_all_heads: bool = False  # OLMo 2: q_norm/k_norm over the whole projection (all heads), before the split
    norm_layout: str = "pre"        # NORM_LAYOUTS
    hidden_act: str = "silu"        # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    embedding_multiplier: float = 1.0  # Granite: embeddings times this
    residual_multiplier: float = 1.0   # Granite: each residual branch times this before its add
    logits_scaling: float = 1.0        # Granite: logits divided by this
    attention_scale: float | None = None  # the query scale when not head_dim ** -0.5 (Gemma 2/3:
                                          # query_pre_attn_scalar ** -0.5; Granite: attention_multiplier)
    partial_rotary_factor: float = 1.0    # Phi-4-mini: RoPE rotates the first rotary_dim features of each head
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (plain RoPE, no scaling)
    local_rope_layers: tuple[int, ...] = ()  # Gemma 3: the layers on that RoPE (its sliding layers)
    norm_offset: float = 0.0        # Gemma: RMSNorm multiplies by (1 + w)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None  # the window of the layers whose type is "sliding_attention"
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES; () = every layer full attention
    attention_sinks: bool = False   # gpt-oss: a learned logit per query head in each softmax's denominator
    # Mixture of experts (models/moe.py; num_experts 0: a dense MLP). Routing: router logits x @ gate; scores by
    # router_scoring over all experts; the top num_experts_per_tok; their weights renormalised to sum 1 where
    # norm_topk_prob. gpt-oss instead takes the top-k logits and softmaxes those (router_topk_first).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_scoring: str = "softmax"
    router_topk_first: bool = False
    norm_topk_prob: bool = False
    router_bias: bool = False           # gpt-oss: the router has a bias
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token also takes
    shared_expert_gate: bool = False    # Qwen2-MoE: the shared expert's output times sigmoid(x @ w)
    expert_bias: bool = False           # gpt-oss: biases on the experts' projections
    swiglu_limit: float | None = None   # gpt-oss: its clamped SwiGLU (gate <= limit, |up| <= limit)
    swiglu_alpha: float = 1.702
    # DeepSeek-V3's router: sigmoid scores, a correction bias added to choose (not to weigh) the experts, the
    # experts in num_expert_groups groups of which the topk_groups best (by their top two scores) are eligible,
    # the weights times routed_scaling_factor. Its first first_k_dense layers keep a dense MLP.
    router_correction_bias: bool = False
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense: int = 0
    # DeepSeek's multi-head latent attention (models/mla.py; kv_lora_rank 0: none). Its KV cache holds per token
    # one latent row [kv_lora_rank normed | qk_rope_head_dim roped] shared by every head; head_dim is then the
    # rotary part's width, and num_kv_heads 1.
    q_lora_rank: int = 0            # 0: q_proj, else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False   # the rotary features in interleaved pairs (x0, x1), (x2, x3), ...
    # Set by models/sharding.shard_model, not read from a checkpoint: on a mesh the experts are split by experts
    # (expert parallel) rather than by each expert's intermediate units (tensor parallel).
    expert_parallel: bool = False
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
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(arrays, heads, head dim) of each layer's KV cache: K and V pages of num_kv_heads x head_dim, or (MLA)
        one array of the latent rows."""
        if self.mla:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def max_context_len(self) -> int:
        """The longest context the model serves: max_position_embeddings, times the factor of dynamic NTK scaling
        (which stretches RoPE past it as a sequence grows, as vLLM derives its max_model_len)."""
        scaling = dict(self.rope_scaling or ())
        if scaling.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """The leading features of each head that RoPE rotates (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_ropes(self) -> tuple[int, ...]:
        """Per layer, which of `ropes()` it takes: Gemma 3's sliding layers the local one (1), the rest 0."""
        return tuple(int(i in self.local_rope_layers) for i in range(self.num_layers))

    def ropes(self) -> tuple["Rope", ...]:
        """The model's RoPEs: the global one, then (Gemma 3) the sliding layers' plain one."""
        main = rope_frequencies(self.rope_theta, dict(self.rope_scaling or ()), self.rotary_dim,
                                self.max_position_embeddings)
        if self.rope_local_theta is None:
            return (main,)
        return main, rope_frequencies(self.rope_local_theta, {}, self.rotary_dim, self.max_position_embeddings)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2] (float32, on the host) of the global RoPE, after any scaling
        (longrope: the short factor's; dynamic: those up to max_position_embeddings)."""
        return self.ropes()[0].inv_freq

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
        d["local_rope_layers"] = tuple(d.get("local_rope_layers") or ())
        return cls(**d)


@dataclasses.dataclass(frozen=True, eq=False)
class Rope:
    """One RoPE, as transformers' modeling_rope_utils computes it (float32): inverse frequencies, and for the
    scalings whose frequencies depend on the sequence's length (longrope, dynamic) what they are chosen by. A
    sequence's length is its context length this step (transformers: max(position_ids) + 1, per forward call)."""

    inv_freq: np.ndarray            # [rotary_dim // 2]; longrope: the short factor's
    attention_factor: float = 1.0   # cos and sin are multiplied by it (yarn, longrope)
    long_inv_freq: np.ndarray | None = None  # longrope: a sequence longer than original_max takes these
    dynamic_factor: float | None = None      # dynamic NTK: past original_max the base grows with the length
    original_max: int = 0           # longrope's original_max_position_embeddings; dynamic's max_position_embeddings
    theta: float = 10000.0

    @property
    def length_dependent(self) -> bool:
        return self.long_inv_freq is not None or self.dynamic_factor is not None


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return _f32(np.float32(1.0) / (np.float32(theta) ** exponents))


def rope_frequencies(theta: float, scaling: dict, dim: int, max_position_embeddings: int) -> Rope:
    """The RoPE of base `theta` over `dim` rotated features under Hugging Face rope parameters `scaling`; the
    functions of transformers' modeling_rope_utils, in float32 as they compute."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = _default_inv_freq(theta, dim)
    if kind == "default":
        return Rope(inv_freq, theta=theta)
    if kind == "linear":
        return Rope(_f32(inv_freq / np.float32(scaling["factor"])), theta=theta)
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
        return Rope(_f32(np.where(medium, smoothed, scaled)), theta=theta)
    if kind == "yarn":
        return _yarn(theta, scaling, dim, max_position_embeddings)
    if kind == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or max_position_embeddings / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        powers = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        factors = [_f32(scaling[key]) for key in ("short_factor", "long_factor")]
        if any(f.shape != powers.shape for f in factors):
            raise ConfigError(f"longrope short_factor and long_factor must have rotary_dim / 2 = {len(powers)} "
                              f"entries each")
        short, long = (_f32(np.float32(1.0) / (f * powers)) for f in factors)
        return Rope(short, float(attention), long_inv_freq=long, original_max=original, theta=theta)
    if kind == "dynamic":
        return Rope(inv_freq, dynamic_factor=float(scaling["factor"]), original_max=max_position_embeddings,
                    theta=theta)
    raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, scaling: dict, dim: int, max_position_embeddings: int) -> Rope:
    """transformers' _compute_yarn_parameters."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    if factor is None:
        factor = max_position_embeddings / original
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = _f32(np.float32(1.0) / pos_freqs)
    interpolation = _f32(np.float32(1.0) / (np.float32(factor) * pos_freqs))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = _f32(np.float32(1.0) - _f32(ramp))
    inv_freq = interpolation * (np.float32(1.0) - extrapolation_factor) + extrapolation * extrapolation_factor
    return Rope(_f32(inv_freq), float(attention), theta=theta)


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
    if model_type == "gemma3":
        hf, model_type = _gemma3_text_config(hf, source), "gemma3_text"

    def need(key):
        if key not in hf:
            raise ConfigError(f"{source}: missing required field {key!r} for model_type {model_type!r}")
        return hf[key]

    hidden, num_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = hf.get("head_dim") or hidden // num_heads
    mla = _mla_fields(hf, model_type, source)
    if mla:
        head_dim = mla.pop("head_dim")
    rope_theta, rope, local_theta, partial = _rope_parameters(hf, model_type, source)

    gemma = model_type in GEMMA_TYPES
    attention_bias = bool(hf.get("attention_bias", False))
    generation = generation or {}
    eos = _as_id_list(generation.get("eos_token_id", hf.get("eos_token_id")))
    bos = generation.get("bos_token_id", hf.get("bos_token_id"))
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    # Gemma's GeGLU is the tanh approximation even where a legacy config says "gelu" (as transformers does).
    if not gemma and act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported for {model_type}")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention is not supported (Ferry serves causal decoders)")

    sliding_window, layer_types = _attention_layout(hf, model_type, source)
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=1 if mla else int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_freeze(rope),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or (attention_bias and model_type != "phi3"),
        # transformers' o_proj takes attention_bias too, but for Qwen2 (q/k/v only) and Phi-3 (none)
        o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe", "phi3"),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2"),
        qk_norm_all_heads=model_type == "olmo2",
        norm_layout=NORM_LAYOUTS.get(model_type, "pre"),
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
        partial_rotary_factor=partial,
        rope_local_theta=local_theta,
        local_rope_layers=() if local_theta is None else tuple(
            i for i, t in enumerate(_declared_layer_types(hf, model_type, source)) if t == "sliding_attention"),
        attention_sinks=model_type == "gpt_oss",
        **_scales(hf, model_type, source),
        **_moe_fields(hf, model_type, source),
        **mla,
    )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {cfg.num_heads} is not a multiple of "
                          f"num_key_value_heads {cfg.num_kv_heads}")
    if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise ConfigError(f"{source}: partial_rotary_factor {partial} gives an odd or empty rotary dim "
                          f"{cfg.rotary_dim} of head_dim {cfg.head_dim}")
    try:
        cfg.ropes()  # fail now on an unknown rope type or a malformed one
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise ConfigError(f"{source}: {e}") from None
        raise ConfigError(f"{source}: rope parameters {dict(rope)} lack or mistype {e}") from None
    return cfg


def _gemma3_text_config(hf: dict, source: str) -> dict:
    """A multimodal Gemma 3 config's language model: its text_config (Ferry serves the text; the checkpoint's
    vision tower is not read, models/checkpoints/tensors.py)."""
    text = hf.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigError(f"{source}: a gemma3 config without a gemma3_text text_config; use the text-only "
                          f"checkpoint (model_type gemma3_text)")
    text = {**text, "model_type": "gemma3_text"}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in hf and key not in text:
            text[key] = hf[key]
    return text


def _rope_parameters(hf: dict, model_type: str, source: str) -> tuple[float, dict, float | None, float]:
    """(rope_theta, the global RoPE's scaling parameters ({} for plain RoPE), Gemma 3's local theta or None,
    partial_rotary_factor) from either format: transformers >= 5's rope_parameters (theta inside; per layer type
    for Gemma 3) or the older rope_theta + rope_scaling (+ rope_local_base_freq)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = None
    if model_type == "gemma3_text":
        if "full_attention" in rope or "sliding_attention" in rope:
            local = dict(rope.get("sliding_attention") or {})
            rope = dict(rope.get("full_attention") or {})
            if local.get("rope_type", local.get("type", "default")) != "default":
                raise ConfigError(f"{source}: rope_parameters['sliding_attention'] of type "
                                  f"{local.get('rope_type', local.get('type'))!r} is not supported (default only)")
            local_theta = local.get("rope_theta")
        local_theta = float(local_theta or hf.get("rope_local_base_freq", 10000.0))
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and model_type not in PARTIAL_ROTARY_TYPES:
        raise ConfigError(f"{source}: partial_rotary_factor is not supported for {model_type}")
    kind = rope.pop("type", None)  # the older name of rope_type
    kind = rope.setdefault("rope_type", kind or "default")
    if kind == "default":
        return theta, {}, local_theta, partial
    if kind in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3) wins.
        original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = int(original or hf.get("max_position_embeddings", 2048))
    return theta, rope, local_theta, partial


def _scales(hf: dict, model_type: str, source: str) -> dict:
    """The query scale and Granite's multipliers, for ModelConfig."""
    out = {}
    if model_type in ("gemma2", "gemma3_text") and hf.get("query_pre_attn_scalar") is not None:
        out["attention_scale"] = float(hf["query_pre_attn_scalar"]) ** -0.5
    if model_type == "granite":
        out.update(attention_scale=float(hf.get("attention_multiplier", 1.0)),
                   embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                   logits_scaling=float(hf.get("logits_scaling", 1.0)))
    else:
        for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if hf.get(key, 1.0) != 1.0:
                raise ConfigError(f"{source}: {key} is not supported for {model_type} (granite only)")
    if out.get("logits_scaling") == 0:
        raise ConfigError(f"{source}: logits_scaling must not be 0")
    return out


def _mla_fields(hf: dict, model_type: str, source: str) -> dict:
    """DeepSeek-V3's latent attention fields, its query scale (qk_head_dim ** -0.5, times YaRN's mscale_all_dim
    factor squared as transformers' yarn_apply_mscale) and head_dim = the rotary width (as transformers sets it)."""
    if model_type != "deepseek_v3":
        return {}
    nope, rope_dim = int(hf.get("qk_nope_head_dim", 128)), int(hf.get("qk_rope_head_dim", 64))
    scale = (nope + rope_dim) ** -0.5
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    if hf.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias is not supported for deepseek_v3")
    return dict(q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
                qk_nope_head_dim=nope, v_head_dim=int(hf.get("v_head_dim") or 128), head_dim=rope_dim,
                rope_interleave=bool(hf.get("rope_interleave", True)), attention_scale=scale)


def _moe_fields(hf: dict, model_type: str, source: str) -> dict:
    """The mixture-of-experts fields of ModelConfig, by family (transformers' config names, and the older
    num_experts of Qwen's config.json files)."""
    if model_type not in MOE_TYPES:
        return {}
    num_experts = hf.get("num_local_experts", hf.get("num_experts", hf.get("n_routed_experts")))
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or not isinstance(top_k, int) or not 0 < top_k <= num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok {top_k!r} must be in [1, the {num_experts!r} experts]")
    out = dict(num_experts=num_experts, num_experts_per_tok=top_k)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        sparse_step, dense_layers = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
        if sparse_step != 1 or dense_layers:
            raise ConfigError(f"{source}: decoder_sparse_step {sparse_step} / mlp_only_layers {dense_layers}: "
                              f"Ferry serves MoE models whose every layer is sparse (decoder_sparse_step 1, "
                              f"mlp_only_layers [])")
        out.update(moe_intermediate_size=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
        if model_type == "qwen2_moe":
            out.update(shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                       shared_expert_gate=True)
    elif model_type == "mixtral":
        out.update(moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    elif model_type == "deepseek_v3":
        groups, topk_groups = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        if num_experts % groups or not 0 < topk_groups <= groups or top_k > topk_groups * (num_experts // groups):
            raise ConfigError(f"{source}: n_group {groups} / topk_group {topk_groups} must split the {num_experts} "
                              f"experts evenly and leave at least num_experts_per_tok {top_k} eligible")
        moe_size = int(hf["moe_intermediate_size"])
        out.update(moe_intermediate_size=moe_size, router_scoring="sigmoid", router_correction_bias=True,
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True)), num_expert_groups=groups,
                   topk_groups=topk_groups, routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   shared_expert_intermediate_size=moe_size * int(hf.get("n_shared_experts") or 0),
                   first_k_dense=int(hf.get("first_k_dense_replace", 0)))
        if not 0 <= out["first_k_dense"] < int(hf.get("num_hidden_layers", 0)):
            raise ConfigError(f"{source}: first_k_dense_replace {out['first_k_dense']} must leave at least one "
                              f"sparse layer")
    elif model_type == "gpt_oss":
        out.update(moe_intermediate_size=int(hf["intermediate_size"]), router_topk_first=True, router_bias=True,
                   expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    return out


def _attention_layout(hf: dict, model_type: str, source: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers reads them (`_declared_layer_types`). A window of None, or
    one not shorter than max_position_embeddings, is no window."""
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen2_moe") and not hf.get("use_sliding_window", False):
        window = None
    types = _declared_layer_types(hf, model_type, source)
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ConfigError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    if window is None or "sliding_attention" not in types or window >= int(hf.get("max_position_embeddings", 2048)):
        return None, ()
    return window, types


def _declared_layer_types(hf: dict, model_type: str, source: str) -> tuple[str, ...]:
    """Each layer's type: `layer_types` where the config has it, else each family's rule (Mistral, Phi-3: every
    layer under `sliding_window`; Qwen2: `use_sliding_window` from layer `max_window_layers` on; Gemma 2: every
    other layer, the first sliding; Gemma 3: every `sliding_window_pattern`th layer full, the rest sliding)."""
    num_layers = int(hf.get("num_hidden_layers", 0))
    types = hf.get("layer_types")
    if types is None:
        if model_type in ("qwen2", "qwen2_moe"):
            first = int(hf.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif model_type in ("gemma2", "gemma3_text"):
            pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern",
                                                                   hf.get("_sliding_window_pattern", 6)))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    types = tuple(types)
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != num_layers:
        raise ConfigError(f"{source}: layer_types must list one of {LAYER_TYPES} for each of the "
                          f"{num_layers} layers (got {len(types)}; unknown: {bad})")
    return types


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
