"""The mixture-of-experts MLP (Mixtral, Qwen2/3-MoE, gpt-oss): a router picks each token's top-k experts, and
the chosen experts run as grouped matmuls over the (token, expert) pairs sorted by expert (`jax.lax.ragged_dot`),
so the work grows with top-k, not with the number of experts; the outputs are weighted and summed back per token.

On a mesh (models/mesh.py) the experts run per shard under `jax.shard_map`, in one of two layouts
(ModelConfig.expert_parallel): expert parallel, each device holding E / tp whole experts; or tensor parallel,
each holding every expert's 1 / tp of the intermediate units. Attention is tensor parallel, so every device holds
every token's activations already: a device computes its experts' (or units') share for all the tokens routed to
them, and one all-reduce (psum) sums the shares, the collective a dense MLP's row-parallel down projection
takes anyway. An all-to-all dispatch pays off only where the tokens are split over the devices (data-parallel
attention), which Ferry's tensor-parallel attention does not do.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.mesh import MODEL_AXIS, model_axis_size
from pallas_kernels import ops

_INIT = nnx.initializers.normal(0.02)


class Gate(nnx.Module):
    """A small projection kept as the checkpoint stores it, weight [out, hidden] (torch's Linear layout), and
    left out of quantization and packing: the router (`gate`, [num_experts, hidden]) and Qwen2-MoE's
    shared_expert_gate ([1, hidden]). `float32`: the logits in float32 (DeepSeek-V3's router computes them so)."""

    def __init__(self, out_features: int, hidden: int, bias: bool, dtype, rngs, correction_bias: bool = False,
                 float32: bool = False):
        self.weight = nnx.Param(_INIT(rngs.params(), (out_features, hidden), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        # DeepSeek-V3: added to the scores to choose the experts, not to weigh them (route); float32 as stored
        self.e_score_correction_bias = (nnx.Param(jnp.zeros((out_features,), jnp.float32)) if correction_bias
                                        else None)
        self.float32 = float32

    def __call__(self, x):
        dtype = jnp.float32 if self.float32 else x.dtype
        y = x.astype(dtype) @ self.weight[...].T.astype(dtype)
        return y if self.bias is None else y + self.bias[...].astype(dtype)


class Experts(nnx.Module):
    """The experts' projections, stacked over experts as `ragged_dot` reads them: gate_up_proj [E, hidden, 2I]
    (each expert's [gate | up] columns), down_proj [E, I, hidden]; gpt-oss's biases [E, 2I], [E, hidden]."""

    def __init__(self, cfg: ModelConfig, dtype, rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nnx.Param(_INIT(rngs.params(), (e, h, 2 * i), dtype))
        self.down_proj = nnx.Param(_INIT(rngs.params(), (e, i, h), dtype))
        if cfg.expert_bias:
            self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * i), dtype))
            self.down_proj_bias = nnx.Param(jnp.zeros((e, h), dtype))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    def params(self) -> dict:
        out = {"gate_up_proj": self.gate_up_proj[...], "down_proj": self.down_proj[...]}
        if self.gate_up_proj_bias is not None:
            out |= {"gate_up_proj_bias": self.gate_up_proj_bias[...], "down_proj_bias": self.down_proj_bias[...]}
        return out


def route(logits, cfg: ModelConfig, correction_bias=None):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32) by the family's rule:
    softmax over all experts, the top k, renormalised where norm_topk_prob (Mixtral, Qwen); (gpt-oss) the top k
    logits, softmaxed among themselves; (DeepSeek-V3) sigmoid scores, chosen by score + correction_bias [E]
    among the experts of the topk_groups best groups, weighed by the score, renormalised, scaled."""
    k = cfg.num_experts_per_tok
    logits = logits.astype(jnp.float32)
    if cfg.router_topk_first:
        top, ids = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), ids
    scores = jax.nn.softmax(logits, axis=-1) if cfg.router_scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if cfg.num_expert_groups > 1:
        choice = _best_groups_only(choice, cfg.num_expert_groups, cfg.topk_groups)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if cfg.router_scoring == "sigmoid"
                                                                           else 0.0))
    return weights * cfg.routed_scaling_factor, ids


def _best_groups_only(choice, num_groups: int, topk_groups: int):
    """choice [T, E] with every expert outside the topk_groups best of the num_groups groups set to -inf, a
    group ranked by the sum of its two best choices (DeepSeek-V3's group-limited routing)."""
    grouped = choice.reshape(*choice.shape[:-1], num_groups, -1)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best = jax.lax.top_k(group_scores, topk_groups)
    keep = jnp.zeros(group_scores.shape, bool).at[jnp.arange(choice.shape[0])[:, None], best].set(True)
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


def expert_activation(gate_up, cfg: ModelConfig, intermediate: int):
    """The experts' gated activation of [gate | up] sums [..., 2I] -> [..., I] (under tensor parallelism a
    shard's own [gate | up] units: sharding.group_fused_projections lays them so): SwiGLU, or gpt-oss's clamped
    form, (clip(up) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""
    gate, up = gate_up[..., :intermediate], gate_up[..., intermediate:]
    if cfg.swiglu_limit is None:
        return ops.gate_product(gate, up, "silu")
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def _tensor_split(cfg: ModelConfig) -> bool:
    return model_axis_size() > 1 and not cfg.expert_parallel


def grouped_experts(x, weights, ids, params: dict, cfg: ModelConfig, first_expert=0, packed_first=None):
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) [T, hidden] (float32), over the experts of `params` (its
    stacks' leading axis: experts first_expert, first_expert + 1, ...): the (token, expert) pairs sorted by expert,
    one grouped matmul per projection. Pairs of other experts (another device's) sort last, outside every group:
    the grouped matmuls leave their rows zero, and their weight is zero.

    `packed_first` (CPU, pack_kernels): params' gate_up_proj and down_proj are packed stacks of every layer's
    experts and this layer's start at that entry; the native grouped matmul reads them in place (XLA CPU's
    ragged_dot computes every expert for every row, and the layer scan would copy the layer's experts)."""
    num_tokens, k = ids.shape
    num_local = cfg.num_experts if packed_first is not None else params["gate_up_proj"].shape[0]
    local = ids.reshape(-1) - first_expert
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    token = order // k
    sorted_expert = jnp.minimum(key[order], num_local - 1)
    xs = x[token]
    units, fused_gate = cfg.moe_intermediate_size, "gate_up_proj_bias" not in params and cfg.swiglu_limit is None
    if packed_first is None:
        matmul = lambda a, name, n, **kw: jax.lax.ragged_dot(a, params[name], group_sizes)  # noqa: E731
    else:
        matmul = lambda a, name, n, **kw: ops.packed_grouped_matmul(  # noqa: E731
            a, params[name], packed_first, group_sizes, n=n, **kw)
    if fused_gate and packed_first is not None:  # SwiGLU in the matmul's panels, as the dense MLP's
        h = matmul(xs, "gate_up_proj", 2 * units, groups=2, gated="silu", dtype=x.dtype)
    else:
        h = matmul(xs, "gate_up_proj", 2 * units, groups=2)
        if "gate_up_proj_bias" in params:
            h = h + params["gate_up_proj_bias"][sorted_expert]
        h = expert_activation(h, cfg, h.shape[-1] // 2).astype(x.dtype)
    y = matmul(h, "down_proj", cfg.hidden_size)
    if "down_proj_bias" in params:
        bias = params["down_proj_bias"][sorted_expert]
        if _tensor_split(cfg):  # every shard's partial sums are psummed: the bias once, on shard 0
            bias = bias * (jax.lax.axis_index(MODEL_AXIS) == 0).astype(bias.dtype)
        y = y + bias
    pair_weights = jnp.where(mine, weights.reshape(-1), 0.0)[order]
    y = y.astype(jnp.float32) * pair_weights[:, None]
    return jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[token].add(y)


# How each expert leaf splits over the model axis: expert parallel by experts, tensor parallel by units.
_EXPERT_PARALLEL_SPECS = {"gate_up_proj": P(MODEL_AXIS), "down_proj": P(MODEL_AXIS),
                          "gate_up_proj_bias": P(MODEL_AXIS), "down_proj_bias": P(MODEL_AXIS)}
_TENSOR_PARALLEL_SPECS = {"gate_up_proj": P(None, None, MODEL_AXIS), "down_proj": P(None, MODEL_AXIS),
                          "gate_up_proj_bias": P(None, MODEL_AXIS), "down_proj_bias": P()}


def expert_param_spec(leaf: str, expert_parallel: bool) -> P:
    """The PartitionSpec of an Experts leaf on the model axis (models/sharding.py places them so)."""
    return (_EXPERT_PARALLEL_SPECS if expert_parallel else _TENSOR_PARALLEL_SPECS)[leaf]


def run_experts(x, weights, ids, params: dict, cfg: ModelConfig):
    """grouped_experts on one device, or per shard of the mesh (see the module docstring) and summed."""
    tp = model_axis_size()
    if tp == 1:
        return grouped_experts(x, weights, ids, params, cfg)

    def shard(x, weights, ids, params):
        first = jax.lax.axis_index(MODEL_AXIS) * params["gate_up_proj"].shape[0] if cfg.expert_parallel else 0
        return jax.lax.psum(grouped_experts(x, weights, ids, params, cfg, first), MODEL_AXIS)

    specs = {leaf: expert_param_spec(leaf, cfg.expert_parallel) for leaf in params}
    return jax.shard_map(shard, in_specs=(P(), P(), P(), specs), out_specs=P())(x, weights, ids, params)


class SparseMoE(nnx.Module):
    """The MoE block in a decoder layer's MLP place: router (`gate`), experts, and Qwen2-MoE's gated shared
    expert (a dense MLP every token takes)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, shared_mlp=None):
        self.cfg = cfg
        self.gate = Gate(cfg.num_experts, cfg.hidden_size, cfg.router_bias, dtype, rngs,
                         correction_bias=cfg.router_correction_bias, float32=cfg.router_scoring == "sigmoid")
        self.experts = Experts(cfg, dtype, rngs)
        self.shared_expert = shared_mlp
        self.shared_expert_gate = Gate(1, cfg.hidden_size, False, dtype, rngs) if cfg.shared_expert_gate else None

    def __call__(self, x, ctx):
        bias = self.gate.e_score_correction_bias
        weights, ids = route(self.gate(x), self.cfg, None if bias is None else bias[...])
        params = self.experts.params()
        if params["down_proj"].ndim == ops.PACKED_RANK:  # pack_kernels: every layer's experts, read in place
            packed_first = (ctx.layer - ctx.stack_first) * self.cfg.num_experts
            out = grouped_experts(x, weights, ids, params, self.cfg, packed_first=packed_first)
        else:
            out = run_experts(x, weights, ids, params, self.cfg)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, ctx).astype(jnp.float32)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)) * shared
            out = out + shared
        return out.astype(x.dtype)
