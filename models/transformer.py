"""One decoder-only transformer for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3, Phi-3,
OLMo 2, Granite).

Module and attribute names follow Hugging Face's (`layers.self_attn.o_proj`), so checkpoint
names map onto the parameter tree mechanically (models/loading.py), except that q/k/v and gate/up
are fused, one matmul each (`qkv_proj`,
                            `gate_up_proj`; FUSED_PROJECTIONS says what each holds). The decoder layers are ONE
`DecoderLayer` whose parameters carry a leading [num_layers] axis, run by `jax.lax.scan`: the step
traces and compiles one layer, so start-up cost does not grow with depth. The forward pass is paged:
it writes this step's K/V into the cache and attends through block tables (models/paged.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig, Rope
from models.mesh import HEADS_SPEC, KV_POOL_SPEC, MODEL_AXIS, fused_groups, model_axis_size, split_columns
from models.mla import LatentAttention
from models.moe import SparseMoE
from models.paged import AttentionMetadata, KVCache, kv_cache_groups, layer_pool
from models.quantization import is_quantized, quantize, quantized_embedding, quantized_matmul
from models.rope import apply_rope  # noqa: F401  (scripts import it from here)
from pallas_kernels import ops
from pallas_kernels.attention import write_kv_and_attend
from pallas_kernels.kernels import Kernels

_INIT = nnx.initializers.normal(0.02)

# Fused parameter -> the Hugging Face projections it holds, concatenated over output features in this
# order (one group; under tensor parallelism one group per shard, models/sharding.fuse_columns).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}


def qkv_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    kv = cfg.num_kv_heads * cfg.head_dim
    return cfg.num_heads * cfg.head_dim, kv, kv


def fused_projection_widths(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(module, fused projection, its parts' widths) for each entry of FUSED_PROJECTIONS the model has."""
    out = [] if cfg.mla else [("self_attn", "qkv_proj", qkv_widths(cfg))]
    if not cfg.num_experts or cfg.first_k_dense:
        out.append(("mlp", "gate_up_proj", (cfg.intermediate_size,) * 2))
    if cfg.num_experts and cfg.shared_expert_intermediate_size:
        out.append(("mlp.shared_expert", "gate_up_proj", (cfg.shared_expert_intermediate_size,) * 2))
    return out


def split_fused(y, widths: tuple[int, ...]) -> list:
    """A fused projection's output [..., sum(widths)] -> its parts, in the layout the parameters have
    under the mesh being traced (one group per shard when the parts split evenly)."""
    return split_columns(y, widths, fused_groups(widths, model_axis_size()))


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardContext:
    """What a module's call needs besides its inputs, handed down as an argument (never set on a module): the
    step's kernels; inside the scanned layers over packed kernels (pack_kernels), the layer's index in the
    stacks; and the real rows of the activations (a bucketed step's padding rows follow them), which a packed
    matmul leaves unwritten."""

    kernels: Kernels
    layer: jax.Array | None = None  # int32 []: the index of the decoder layer being run (None: outside them)
    packed: bool = False            # its linears are packed [num_layers, ...] stacks read at `layer`, its norms
                                    # take the native kernel
    stack_first: int = 0            # the first layer of the stack `layer` is in (transformer.layer_stacks)
    rows: jax.Array | None = None   # int32 []: the real rows of x (None: all of them)

    def with_rows(self, rows) -> "ForwardContext":
        return dataclasses.replace(self, rows=rows)


class RMSNorm(nnx.Module):
    """Llama: w * normalize(x).to(dtype).  Gemma (offset 1): (normalize(x) * (1 + w)).to(dtype)."""

    def __init__(self, dim: int, eps: float, offset: float, dtype):
        self.eps, self.offset = eps, offset
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))

    def __call__(self, x, ctx: ForwardContext, delta=None):
        """RMSNorm(x); given a residual branch `delta` (float32 or x's dtype), of the residual sum
        x + delta.astype(x.dtype) instead, returned beside it: (normed, sum). A packed layer's norms take the
        native kernel."""
        return ops.rms_norm(x, self.weight[...], eps=self.eps, offset=self.offset, delta=delta,
                            native_kernel=ctx.packed)


class Linear(nnx.Linear):
    """nnx.Linear, or over a kernel packed for the native matmul (pack_kernels) the packed matmul: inside the
    scanned layers the whole [num_layers, ...] parameter, the context's layer index picking its panels where
    they lie; the LM head a stack of one."""

    column_groups = 1  # the kernel's equal column parts (a fused [gate | up]: 2), each packed apart

    def __call__(self, x, ctx: ForwardContext):
        kernel = self.kernel.get_value()
        if kernel.ndim == ops.PACKED_RANK:  # float32 sums, rounded once to the model's dtype as `ops.matmul` does
            y = self.packed_matmul(x, ctx).astype(self.dtype)
        elif is_quantized(kernel):
            y = quantized_matmul(x.astype(self.dtype), kernel).astype(self.dtype)
        else:
            y = ops.matmul(x.astype(self.dtype), kernel, ctx.kernels)
        return y if self.bias is None else y + self.bias[...]

    @property
    def packed_sums(self) -> bool:
        """Whether packed_matmul's float32 sums are this layer's output before its rounding (a packed kernel,
        no bias): what a native epilogue (the MLP's gate, the residual add) can take straight."""
        return self.kernel.get_value().ndim == ops.PACKED_RANK and self.bias is None

    def float32_out(self, x, ctx: ForwardContext):
        """self(x).astype(float32): the LM head's logits, a residual branch for RMSNorm's add. A packed
        kernel rounds its float32 sums to the model dtype's precision as it stores them, where XLA
        would convert [rows, vocab] to the dtype and back."""
        if self.packed_sums:
            return self.packed_matmul(x, ctx, round_to=self.dtype)
        return self(x, ctx).astype(jnp.float32)

    def packed_matmul(self, x, ctx: ForwardContext, **kwargs):
        """The packed matmul of x over this kernel: the context's layer of the stack (the head, a stack of one: 0),
        its real rows."""
        layer = ctx.layer - ctx.stack_first if ctx.packed else 0
        return ops.packed_matmul(x.astype(self.dtype), self.kernel.get_value(), layer, n=self.out_features,
                                 groups=self.column_groups, rows=ctx.rows, **kwargs)


def _linear(cfg_in, cfg_out, bias, dtype, rngs):
    return Linear(cfg_in, cfg_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
                  kernel_init=_INIT, rngs=rngs)


def packs_kernels(kernels: Kernels, dtype, tensor_parallel_size: int) -> bool:
    """Whether the scanned layers' linears and the LM head run on packed kernels (pack_kernels): the native CPU
    kernels, no tensor parallelism (XLA partitions the stacks' dots), float32 or bfloat16 weights. XLA CPU
    widens a scanned bf16 stack to float32 whole on every step and copies each layer's slice of a float32 stack;
    the packed matmul reads each layer's panels where they lie (scripts/bench_native_matmul.py)."""
    if not kernels.native or tensor_parallel_size != 1:
        return False
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _linear_kernels(graphdef: nnx.GraphDef, state: nnx.State) -> dict[tuple, int]:
    """{path of a kernel: its column groups} for the scanned layers' linears and the LM head: the untied head's
    kernel, or the tied embedding where it is quantized (held as the head's [D, V] kernel, QuantizedWeight)."""
    model = nnx.merge(graphdef, state)
    kernels = {path + ("kernel",): module.column_groups for path, module in nnx.iter_modules(model)
               if isinstance(module, Linear) and path[:1] in (("layers",), ("dense_layers",), ("lm_head",))}
    if model.cfg.tie_word_embeddings and is_quantized(model.embed_tokens.embedding.get_value()):
        kernels["embed_tokens", "embedding"] = 1
    return kernels


def _map_kernels(graphdef, state, fn) -> nnx.State:
    """`state` with fn(kernel, groups, stacked) in place of each of _linear_kernels' kernels."""
    kernels = _linear_kernels(graphdef, state)

    def mapped(path, leaf):
        names = tuple(getattr(key, "key", getattr(key, "name", None)) for key in path)
        names = names[:-1] if names[-1] == "value" else names
        return leaf if names not in kernels else fn(leaf, kernels[names], names[0] in ("layers", "dense_layers"))

    return jax.tree_util.tree_map_with_path(mapped, state, is_leaf=is_quantized)


def pack_kernels(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.State:
    """A scanned model's state with its layers' linear kernels [L, K, N] and its LM head [K, N] (as a stack
    of one; quantized: the tied embedding too) replaced by their packed form (ops.pack_stacked), which only
    the packed matmul reads: call it where packs_kernels holds. `state` itself is left as it was (it may
    serve other engines); the kernels are packed one at a time, and already packed ones kept. fp8 kernels,
    which the native matmul does not read, stay as they are."""
    pack = jax.jit(ops.pack_stacked, static_argnums=1)

    def packed(leaf, groups, stacked):
        if leaf.ndim != (3 if stacked else 2) or (
                is_quantized(leaf) and jnp.dtype(leaf.values.dtype) == jnp.float8_e4m3fn):
            return leaf
        return pack(leaf if stacked else jax.tree.map(lambda a: a[None], leaf), groups)

    return _pack_experts(_map_kernels(graphdef, state, packed))


# An MoE layer's expert stacks [L, E, K, N] and their column groups (a fused [gate | up]: 2).
EXPERT_STACKS = {"gate_up_proj": 2, "down_proj": 1}


def _pack_experts(state: nnx.State) -> nnx.State:
    """The MoE layers' expert stacks [L, E, K, N] packed as one stack of L x E entries (ops.pack_stacked), which
    the native grouped matmul reads a layer's experts from (models/moe.py)."""
    pack = jax.jit(ops.pack_stacked, static_argnums=1)

    def packed(path, leaf):
        names = tuple(getattr(key, "key", getattr(key, "name", None)) for key in path)
        names = names[:-1] if names[-1] == "value" else names
        if names[-2:-1] != ("experts",) or names[-1] not in EXPERT_STACKS or leaf.ndim != 4:
            return leaf
        return pack(leaf.reshape(-1, *leaf.shape[2:]), EXPERT_STACKS[names[-1]])

    return jax.tree_util.tree_map_with_path(packed, state, is_leaf=is_quantized)


# The LM head (a tied embedding with it) is quantized to int8 per channel under every method, as llama.cpp's
# 4-bit files keep token_embd and output at 6 or 8 bits: SmolLM2's held-out perplexity rises by 60% with an
# int4 head (scripts/eval_tasks.py; docs/models.md).
HEAD_QUANTIZATION = "int8"


def quantize_kernels(graphdef: nnx.GraphDef, state: nnx.State, method: str, group_size: int | None = None):
    """A model's state with its layers' linear kernels quantized weight-only (models/quantization.py `quantize`:
    int8, int4 or fp8; a stack's scales per layer), and its LM head (the tied embedding, held as the head's
    [D, V] kernel) to HEAD_QUANTIZATION. A kernel already quantized (a GGUF's) is an error: it is not
    quantized twice."""
    tied = nnx.merge(graphdef, state).cfg.tie_word_embeddings

    def quantized(path, leaf):
        names = tuple(getattr(key, "key", getattr(key, "name", None)) for key in path)
        names = names[:-1] if names[-1] == "value" else names
        head = names == ("embed_tokens", "embedding")
        if not (names[0] in ("layers", "dense_layers", "lm_head") and names[-1] == "kernel" or head and tied):
            return leaf
        if is_quantized(leaf):
            raise ValueError(f"quantization={method!r}: the checkpoint's {'.'.join(map(str, names))} is "
                             f"quantized already ({leaf.describe()}); leave quantization unset")
        if head or names[0] == "lm_head":  # int8 per channel whatever the method: see HEAD_QUANTIZATION
            return quantize(leaf.T if head else leaf, HEAD_QUANTIZATION)
        return quantize(leaf, method, group_size, stacked=leaf.ndim == 3)  # the scanned stack: per layer

    return jax.tree_util.tree_map_with_path(quantized, state, is_leaf=is_quantized)


def _is_kernel(path, _value) -> bool:
    """A linear's kernel or an expert stack: what a packed layer scan closes over rather than slices."""
    return path[-1] == "kernel" or (len(path) > 1 and path[-2] == "experts" and path[-1] in EXPERT_STACKS)


def layer_kernels_packed(layers) -> bool:
    """Whether a Transformer's layers hold packed kernels (pack_kernels)."""
    return not isinstance(layers, nnx.List) and layers.self_attn.o_proj.kernel.get_value().ndim == ops.PACKED_RANK


def rope_cos_sin(inv_freq, positions, dtype, attention_factor: float = 1.0):
    """cos, sin [T, rotary_dim] in the half-split layout transformers uses (rotate_half), times the rope's
    attention factor (yarn, longrope). inv_freq: [rotary_dim // 2], or per token [T, rotary_dim // 2]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def token_inv_freq(rope: Rope, seq_lens):
    """A length-dependent rope's inverse frequencies per token [T, rotary_dim // 2], from each token's sequence
    length `seq_lens` [T] (transformers: max(position_ids) + 1 of the forward call). Longrope: the long factors
    past original_max; dynamic NTK: the base grown for the length (float32, as transformers computes it)."""
    past = seq_lens[:, None] > rope.original_max
    if rope.long_inv_freq is not None:
        return jnp.where(past, jnp.asarray(rope.long_inv_freq), jnp.asarray(rope.inv_freq))
    dim = 2 * rope.inv_freq.shape[0]
    factor = jnp.float32(rope.dynamic_factor)
    length = jnp.maximum(seq_lens, rope.original_max).astype(jnp.float32)
    base = jnp.float32(rope.theta) * ((factor * length / jnp.float32(rope.original_max)) - (factor - 1)) ** (
        jnp.float32(dim / (dim - 2)))
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / jnp.float32(dim)
    return jnp.float32(1.0) / (base[:, None] ** exponents[None, :])


def token_seq_lens(md: AttentionMetadata, num_tokens: int):
    """Each token row's sequence's context length this step [T] (padding rows: the last sequence's)."""
    seq = jnp.searchsorted(md.query_start_loc[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")
    return md.context_lens[jnp.minimum(seq, md.context_lens.shape[0] - 1)]


def rope_tables(cfg: ModelConfig, positions, md: AttentionMetadata, dtype):
    """cos, sin [T, rotary_dim] of the model's one RoPE, or [num_ropes, T, rotary_dim] of several (Gemma 3: global,
    local), a layer taking cfg.layer_ropes[layer]'s. Longrope and dynamic NTK choose per sequence from its context
    length this step, and a key keeps the rotation it was written with (transformers: max(position_ids) + 1 of
    each forward call, its cache likewise). The one divergence, longrope: a sequence that passes original_max after
    its first chunk (a chunked prefill whose first chunk ends before it, or a decode step) keeps its earlier keys
    rotated with the short factors, where transformers' Phi-3 generate drops its cache at that step and recomputes
    the whole sequence with the long ones (Phi3ForCausalLM.prepare_inputs_for_generation). A prompt that passes it
    in one chunk, or a sequence that never does, matches. Dynamic NTK's frequencies change with every length past
    its threshold, in transformers as here, so there any chunking of a prompt past it rotates differently from
    one chunk."""
    tables = []
    for rope in cfg.ropes():
        inv_freq = jnp.asarray(rope.inv_freq)
        if rope.length_dependent:
            inv_freq = token_inv_freq(rope, token_seq_lens(md, positions.shape[0]))
        tables.append(rope_cos_sin(inv_freq, positions, dtype, rope.attention_factor))
    if len(tables) == 1:
        return tables[0]
    return tuple(jnp.stack(t) for t in zip(*tables))


@dataclasses.dataclass(frozen=True, slots=True)
class KeptRows:
    """The rows a layer keeps past its K/V write (the last layer of a prefill or mixed step): the linears that
    read them are called with their real rows (ForwardContext.rows)."""

    indices: jax.Array  # int32 [S]: each sequence's last token row, the real sequences first
    real: jax.Array     # int32 []: the real sequences among them (the rest are a bucket's padding)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs):
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = _linear(h, sum(qkv_widths(cfg)), cfg.qkv_bias, dtype, rngs)
        self.o_proj = _linear(cfg.num_heads * d, h, cfg.o_bias, dtype, rngs)
        if cfg.qk_norm:  # per head, or (OLMo 2) over all heads of the projection
            q_width, k_width, _ = qkv_widths(cfg) if cfg.qk_norm_all_heads else (d, d, d)
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, cfg.norm_offset, dtype)
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, cfg.norm_offset, dtype)
        # gpt-oss: a learned logit per query head that joins each softmax's denominator (pallas_kernels/reference.py)
        self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), dtype)) if cfg.attention_sinks else None

    def project(self, x, ctx: ForwardContext):
        """x [..., hidden] -> q [..., Hq, D], k and v [..., Hkv, D] (one matmul), q/k normed if the model does."""
        cfg = self.cfg
        q, k, v = split_fused(self.qkv_proj(x, ctx), qkv_widths(cfg))
        if cfg.qk_norm_all_heads:
            # Global view: under tensor parallelism q and k are column-sharded and XLA's partitioner all-reduces
            # the norm's sum of squares across the shards.
            q, k = self.q_norm(q, ctx), self.k_norm(k, ctx)
        heads = lambda t, n: t.reshape(*t.shape[:-1], n, cfg.head_dim)  # noqa: E731
        q, k, v = heads(q, cfg.num_heads), heads(k, cfg.num_kv_heads), heads(v, cfg.num_kv_heads)
        if cfg.qk_norm and not cfg.qk_norm_all_heads:
            q, k = self.q_norm(q, ctx), self.k_norm(k, ctx)
        return q, k, v

    def __call__(self, x, cos, sin, kv, md: AttentionMetadata, ctx: ForwardContext, kept=None):
        """-> (the output projection, float32 at the model dtype's precision; the updated kv).
        `kept` (KeptRows): every row writes its K/V, but only the kept rows query, as decode rows do, and the
        output has only them."""
        cfg = self.cfg
        q, k, v = self.project(x, ctx)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out_ctx = ctx
        if kept is not None:
            q, md, out_ctx = q[kept.indices], md.last_rows_queried(), ctx.with_rows(kept.real)
        num_tokens = q.shape[0]
        attend = functools.partial(_write_and_attend, cfg=cfg, kernels=ctx.kernels)
        sinks = None if self.sinks is None else self.sinks[...].astype(jnp.float32)
        if model_axis_size() > 1:
            # Per shard: its query heads, its KV heads, its pages. XLA cannot partition the kernels'
            # custom calls, and would otherwise gather the whole cache onto every device.
            pages = (KV_POOL_SPEC, KV_POOL_SPEC)
            attend = jax.shard_map(attend, in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, pages, P(), P(MODEL_AXIS)),
                                   out_specs=(HEADS_SPEC, pages))
        out, kv = attend(q, k, v, kv, md, sinks)
        return self.o_proj.float32_out(out.reshape(num_tokens, -1), out_ctx), kv


def _write_and_attend(q, k, v, kv, md: AttentionMetadata, sinks, *, cfg: ModelConfig, kernels: Kernels):
    """This step's k/v [T, Hkv, D] into the pages, then q [T, Hq, D] attends through them (`sinks`: None, or
    float32 [Hq])."""
    out, k_pages, v_pages = write_kv_and_attend(
        q, k, v, *kv, md.slot_mapping, md.block_tables, md.context_lens, md.query_start_loc, decode=md.decode,
        scale=cfg.query_scale, kernels=kernels, soft_cap=cfg.attn_logit_softcap, sliding_window=md.sliding_window,
        sinks=sinks)
    return out, (k_pages, v_pages)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs, intermediate_size: int | None = None):
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = _linear(h, 2 * i, cfg.mlp_bias, dtype, rngs)
        self.gate_up_proj.column_groups = 2
        self.down_proj = _linear(i, h, cfg.mlp_bias, dtype, rngs)
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.intermediate_size = i

    def __call__(self, x, ctx: ForwardContext):
        act, proj = ("gelu_tanh" if self.gelu else "silu"), self.gate_up_proj
        if proj.packed_sums:
            # A packed stack (scanned layers on CPU): the activation runs in the matmul's panels, with
            # no float32 [tokens, 2I] round trip through memory.
            hidden = proj.packed_matmul(x, ctx, gated=act, dtype=proj.dtype)
        else:
            hidden = ops.gate_product(*split_fused(proj(x, ctx), (self.intermediate_size,) * 2), act)
        return self.down_proj(hidden, ctx)


def mlp_block(cfg: ModelConfig, dtype, rngs, sparse: bool = True) -> nnx.Module:
    """A decoder layer's MLP: dense (also DeepSeek's first layers: `sparse` False), or a mixture of experts
    (models/moe.py) with its shared expert if any."""
    if not (cfg.num_experts and sparse):
        return MLP(cfg, dtype, rngs)
    shared = cfg.shared_expert_intermediate_size
    return SparseMoE(cfg, dtype, rngs, MLP(cfg, dtype, rngs, shared) if shared else None)


class DecoderLayer(nnx.Module):
    """One decoder layer; its norms by cfg.norm_layout (config.NORM_LAYOUTS): Llama's pre-norms, Gemma 2/3's
    sandwich (pre-norms and norms of each branch's output), OLMo 2's branch-output norms alone."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, sparse: bool = True):
        """`sparse`: an MoE model's layer has its MoE block (False: DeepSeek's first, dense-MLP layers)."""
        self.layout, self.residual_multiplier = cfg.norm_layout, cfg.residual_multiplier
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset, dtype)
        if cfg.norm_layout != "post":
            self.input_layernorm = norm()
        if cfg.mla:
            self.self_attn = LatentAttention(cfg, dtype, rngs, lambda i, o: _linear(i, o, False, dtype, rngs),
                                             lambda dim: RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset, dtype))
        else:
            self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = norm()
        if cfg.norm_layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if cfg.norm_layout != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = mlp_block(cfg, dtype, rngs, sparse)

    def __call__(self, x, cos, sin, kv, md, ctx: ForwardContext, kept=None):
        """`kept` (see Attention): the output has only those rows, and only they run past the K/V write."""
        attn_in = x if self.layout == "post" else self.input_layernorm(x, ctx)
        attn_out, kv = self.self_attn(attn_in, cos, sin, kv, md, ctx, kept)
        if kept is not None:
            x, ctx = x[kept.indices], ctx.with_rows(kept.real)
        if self.layout == "pre":
            # the residual add, then the norm
            hidden, x = self.post_attention_layernorm(x, ctx, self.scaled_branch(attn_out))
            return x + self.scaled_branch(self.mlp(hidden, ctx)), kv
        attn_out = self.post_attention_layernorm(attn_out.astype(x.dtype), ctx)
        if self.layout == "sandwich":
            hidden, x = self.pre_feedforward_layernorm(x, ctx, attn_out)
        else:
            x = hidden = x + attn_out
        return x + self.post_feedforward_layernorm(self.mlp(hidden, ctx), ctx), kv

    def scaled_branch(self, branch):
        """A residual branch times Granite's residual_multiplier (others: as it is)."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


def stack_modules(modules: list[nnx.Module]) -> nnx.Module:
    """Modules of one structure -> one module whose every array has a leading [len(modules)] axis.
    Built one by one first, so the random initialisation draws exactly as an unrolled stack would."""
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.split(m)[1] for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *leaves: jnp.stack(leaves), *states))


def vmapped_layers(cfg: ModelConfig, dtype, rngs: nnx.Rngs, count: int, sparse: bool = True) -> "DecoderLayer":
    """The same stacked layer as stack_modules gives (the same graphdef; other random draws), from one
    vmapped constructor: tracing it costs the same at any depth (layer by layer it grows with depth), but run
    eagerly each op compiles per depth."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs):
        return DecoderLayer(cfg, dtype, layer_rngs, sparse)

    return make(rngs)


def layer_stacks(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(attribute, first layer, layers, sparse) of each scanned stack of decoder layers, in order: DeepSeek's
    first_k_dense dense-MLP layers (`dense_layers`), then the rest (`layers`: every layer, for other families)."""
    dense = cfg.first_k_dense
    return ([("dense_layers", 0, dense, False)] if dense else []) + [("layers", dense, cfg.num_layers - dense, True)]


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, scan: bool = True,
                 traced: bool = False):
        """`scan`: the layers as one DecoderLayer of [num_layers, ...] parameters, run by jax.lax.scan
        (compile time independent of depth); False: one DecoderLayer per layer, unrolled (see scan_layers).
        `traced`: built under a trace (abstract_model's nnx.eval_shape), where vmapped_layers is cheaper."""
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                      embedding_init=_INIT, rngs=rngs)
        if not scan:
            self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, i >= cfg.first_k_dense)
                                    for i in range(cfg.num_layers)])
        for name, _, count, sparse in layer_stacks(cfg) if scan else ():
            if traced:
                stack = vmapped_layers(cfg, dtype, rngs, count, sparse)
            else:
                stack = stack_modules([DecoderLayer(cfg, dtype, rngs, sparse) for _ in range(count)])
            setattr(self, name, stack)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def __call__(self, kv_cache: KVCache, token_ids, positions, md: AttentionMetadata, logits_indices,
                 kernels: Kernels, hidden_states: bool = False):
        """token_ids, positions [T] -> (float32 logits [len(logits_indices), vocab], updated cache).
        `hidden_states` (pooling, for embeddings): the final norm's output of every token row [T, hidden] instead
        of logits, the LM head skipped (`logits_indices` is then unused)."""
        cfg = self.cfg
        x = self.embed(token_ids)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier
        cos, sin = rope_tables(cfg, positions, md, x.dtype)
        if cos.ndim == 3:  # one table per RoPE: each layer takes its own
            layer_ropes = jnp.asarray(cfg.layer_ropes, jnp.int32)
            rope_of = lambda ctx: (cos[layer_ropes[ctx.layer]], sin[layer_ropes[ctx.layer]])  # noqa: E731
        else:
            rope_of = lambda ctx: (cos, sin)  # noqa: E731
        num_blocks, block_size = kv_cache[0].shape[1:3]
        groups = kv_cache_groups(cfg)

        def layer_step(layer, carry, ctx, kept=None):
            x, pools = carry
            return layer(x, *rope_of(ctx), pools, md.for_layer(ctx.layer, num_blocks, block_size, groups), ctx, kept)

        # The real token rows and logits rows: a bucketed step's padding comes after them (its sequences start
        # at the end of the tokens), and packed kernels skip it.
        rows = md.query_start_loc[-1]
        all_logits = hidden_states or len(logits_indices) == len(token_ids)
        logits_rows = rows if all_logits else jnp.sum(md.query_start_loc[:-1] < rows)
        # A prompt's rows other than its last are only K/V for later tokens: past the last layer's K/V write
        # they are never read, so that layer's query, output projection and MLP run on the logits rows alone
        # (a sequence's last row each). A decode step's rows are all logits rows already.
        last_step = None
        if not (md.decode or all_logits):
            last_step = functools.partial(layer_step, kept=KeptRows(logits_indices, logits_rows))
        # The cache rides in the carry as one pool of every layer's pages: each layer scatters into
        # it and its kernel reads it in place (a per-layer slice would copy the layer's pages).
        ctx = ForwardContext(kernels, rows=rows)
        x, pools = self.scan_layers(layer_step, (x, tuple(layer_pool(pages) for pages in kv_cache)), ctx,
                                    last=last_step)
        new_cache = tuple(pool.reshape(pages.shape) for pool, pages in zip(pools, kv_cache))
        if hidden_states:
            return self.norm(x, ctx), new_cache
        # Only the rows we sample from (RMSNorm is per token): the last layer kept only them, or select them.
        x = self.norm(x if last_step is not None else x[logits_indices], ctx)
        table = self.embed_tokens.embedding.get_value()
        if cfg.tie_word_embeddings and table.ndim == ops.PACKED_RANK:  # quantized, packed: as Linear.float32_out
            logits = ops.packed_matmul(x.astype(self.dtype), table, 0, n=cfg.vocab_size, rows=logits_rows,
                                       round_to=self.dtype)
        elif cfg.tie_word_embeddings and is_quantized(table):  # the head's [D, V] kernel
            logits = quantized_matmul(x.astype(self.dtype), table).astype(self.dtype)
        elif cfg.tie_word_embeddings:
            logits = ops.matmul(x.astype(self.dtype), table, kernels, transpose_w=True)
        else:
            logits = self.lm_head.float32_out(x, ctx.with_rows(logits_rows))
        if model_axis_size() > 1:
            # Vocabulary-sharded rows, then one all-gather of them for the sampler: left free, XLA may
            # all-gather the [hidden, vocab] head instead (seen for prefill), gigabytes on a real model.
            logits = jax.lax.with_sharding_constraint(logits, P(None, MODEL_AXIS))
            logits = jax.lax.with_sharding_constraint(logits, P())
        logits = logits.astype(jnp.float32)
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcap:
            logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
        return logits, new_cache

    def embed(self, token_ids):
        """The token embeddings [T, hidden]; a quantized table (the tied head's [D, V] kernel, maybe packed)
        dequantized row by row."""
        table = self.embed_tokens.embedding.get_value()
        if table.ndim == ops.PACKED_RANK:
            return ops.packed_columns(table, token_ids, self.cfg.hidden_size).astype(self.dtype)
        if is_quantized(table):
            return quantized_embedding(table, token_ids).astype(self.dtype)
        return self.embed_tokens(token_ids)

    def scan_layers(self, fn, carry, ctx: ForwardContext, last=None):
        """`carry` through every layer in order, one traced layer (jax.lax.scan): fn(layer, carry, layer_ctx)
        -> carry, where layer is a DecoderLayer holding that layer's parameters and layer_ctx is `ctx` with the
        layer's index (and whether its linears are packed stacks). Per-layer modules (scan=False) run unrolled.
        `last`: the last layer runs last(layer, carry, layer_ctx) instead of fn, outside the scan.

        The scan's slice of a stacked array is a copy on XLA CPU: its library dots take static slices only,
        so every step would copy each layer's weights. Packed kernels (pack_kernels: CPU, float32 or bfloat16)
        stay out of the scanned operands: the body closes over the whole stacks and each Linear's packed
        matmul reads its layer where it lies. The small parameters (norms, biases) are still sliced; the norms
        run natively too. The layer outside the scan reads its parameters the same way (a dynamic index, as
        the scan does), so no [num_layers - 1, ...] slice of the stacks is made."""
        num_layers = self.cfg.num_layers
        if isinstance(self.layers, nnx.List):
            for i, layer in enumerate(self.layers):
                is_last = last is not None and i == num_layers - 1
                carry = (last if is_last else fn)(layer, carry, dataclasses.replace(ctx, layer=jnp.int32(i)))
            return carry
        stacks = layer_stacks(self.cfg)  # DeepSeek's dense-MLP layers first, then the rest
        for name, first, count, _ in stacks:
            final = name == stacks[-1][0]
            carry = self._scan_stack(getattr(self, name), first, count, fn, carry, ctx, last if final else None)
        return carry

    def _scan_stack(self, layers, first: int, count: int, fn, carry, ctx: ForwardContext, last):
        """scan_layers over one stack of `count` layers, the model's layers first, first + 1, ..."""
        kernels_in_place = layer_kernels_packed(layers)
        if kernels_in_place and model_axis_size() != 1:
            raise ValueError("packed layer kernels (pack_kernels) run on one device; tensor parallelism "
                             "partitions the [num_layers, K, N] stacks")
        if kernels_in_place:
            graphdef, kernels, stacked = nnx.split(layers, _is_kernel, ...)
        else:
            graphdef, stacked = nnx.split(layers)

        def layer_at(index):
            """Layer `index`'s module and context. On the CPU a barrier materialises the sliced parameters once,
            so the matmuls stay library dots (left fusible, XLA CPU folds the dynamic-slice into them, making them
            generic loops). Not on an accelerator: there it would copy every layer's weights each step (weight
            reads are what bounds decode), where XLA's dots read the layer in place from the stack."""
            layer_state = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index - first, keepdims=False),
                                       stacked)
            if ctx.kernels.platform == "cpu":
                layer_state, index = jax.lax.optimization_barrier((layer_state, index))
            layer_ctx = dataclasses.replace(ctx, layer=index, packed=kernels_in_place, stack_first=first)
            if not kernels_in_place:
                return nnx.merge(graphdef, layer_state), layer_ctx
            return nnx.merge(graphdef, kernels, layer_state), layer_ctx

        def body(c, index):
            layer, layer_ctx = layer_at(index)
            return fn(layer, c, layer_ctx), None

        scanned = count - (last is not None)
        indices = jnp.arange(first, first + count, dtype=jnp.int32)
        carry = jax.lax.scan(body, carry, indices[:scanned])[0]
        if last is None:
            return carry
        layer, layer_ctx = layer_at(indices[count - 1])
        return last(layer, carry, layer_ctx)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StaticGraphDef:
    """A model's nnx.GraphDef as a jit static argument, hashed once. jax hashes static arguments on every
    call, and a GraphDef rehashes all its nodes each time (a share of every step's host time)."""

    graphdef: nnx.GraphDef
    hash: int

    @classmethod
    def of(cls, graphdef: nnx.GraphDef) -> "StaticGraphDef":
        return cls(graphdef, hash(graphdef))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraphDef) and self.hash == other.hash
                                 and self.graphdef == other.graphdef)


def forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, kernels: Kernels,
            hidden_states: bool = False):
    """The pure function the engine jits: the split model state in, logits (or with `hidden_states` the final
    hidden states: Transformer.__call__) and the new cache out. `graphdef`: an nnx.GraphDef or a StaticGraphDef."""
    if isinstance(graphdef, StaticGraphDef):
        graphdef = graphdef.graphdef
    model = nnx.merge(graphdef, state)
    return model(kv_cache, token_ids, positions, md, logits_indices, kernels, hidden_states)
