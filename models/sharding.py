"""Tensor parallelism: Megatron-style parameter shardings over the mesh's model axis (models/mesh.py), with the
KV cache sharded over KV heads. XLA's SPMD partitioner does the rest (the all-reduces after o_proj and
down_proj, the vocabulary-sharded embedding and LM head); the attention kernels are custom calls it
cannot see into, so `Attention` runs them per shard under `jax.shard_map` (see `model_axis_size`).
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.loading import abstract_model
from models.mesh import MODEL_AXIS, fuse_columns, fused_groups, split_columns
from models.moe import expert_param_spec
from models.transformer import fused_projection_widths, layer_stacks, qkv_widths

QUANTIZED_LEAVES = ("values", "scales", "offsets")  # models/quantization.py QuantizedWeight's fields

log = logging.getLogger("ferry")

# Parameter name suffix -> the axis (counted from the end) split over the model axis.
# Column-parallel (output features = heads or MLP units): the fused q/k/v and gate/up projections
# (laid out shard by shard, see `fuse_columns`); row-parallel (input features): o, down, whose partial
# sums XLA all-reduces; the vocabulary: embedding rows, LM head columns.
_SPLIT_AXIS = {
    "qkv_proj.kernel": -1, "qkv_proj.bias": -1, "gate_up_proj.kernel": -1, "gate_up_proj.bias": -1,
    "o_proj.kernel": -2, "down_proj.kernel": -2,
    "embed_tokens.embedding": -2, "lm_head.kernel": -1,
    "self_attn.sinks": -1,  # per query head, as the heads split
    # MLA (models/mla.py): the query and latent up-projections are head-major, column-parallel by heads; the
    # down-projections to the latent (q_a_proj, kv_a_proj_with_mqa) stay whole
    "q_b_proj.kernel": -1, "q_proj.kernel": -1, "kv_b_proj.weight": -2,
}


def check_tensor_parallel(cfg, tp: int) -> None:
    """Attention splits by query heads, and each shard must own whole KV heads (or one replica of one); an MoE
    model's experts split whole (expert parallel) or by units."""
    if cfg.num_experts and cfg.expert_parallel and cfg.num_experts % tp:
        raise ValueError(f"expert_parallel over {tp} devices must divide the model's {cfg.num_experts} experts")
    if cfg.num_experts and not cfg.expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the experts' {cfg.moe_intermediate_size} "
                         f"units (or set expert_parallel)")
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} must divide, or be a multiple of, the model's "
                         f"{cfg.num_kv_heads} KV heads")


def param_spec(name: str, shape: tuple[int, ...], tp: int, expert_parallel: bool = False) -> P:
    """The PartitionSpec of parameter `name` (dotted, e.g. "layers.mlp.up_proj.kernel"); replicated
    where no rule applies or the split axis does not divide evenly (logged)."""
    base, _, leaf = name.rpartition(".")
    if base.endswith("mlp.experts") and tp > 1:  # [num_layers, E, ...]: models/moe.py's layouts
        return P(None, *expert_param_spec(leaf, expert_parallel))
    if leaf in QUANTIZED_LEAVES:  # a QuantizedWeight's values, scales, offsets: split as its kernel
        # (row-parallel scales by groups); a quantized embedding is the tied head's [D, V] kernel
        name = "lm_head.kernel" if base == "embed_tokens.embedding" else base
    axis = next((a for suffix, a in _SPLIT_AXIS.items() if name.endswith(suffix)), None)
    if axis is None or tp == 1:
        return P()
    if shape[axis] % tp:
        log.warning("tensor parallel: %s %s is replicated (%d does not split %d ways)", name, shape, shape[axis], tp)
        return P()
    spec = [None] * len(shape)
    spec[axis] = MODEL_AXIS
    return P(*spec)


def _repeat_kv_columns(value, cfg, repeats: int):
    """A q/k/v projection's columns (kernel, bias, or a QuantizedWeight's leaf) with each KV head's repeated."""
    q, k, v = split_columns(value, qkv_widths(cfg), 1)
    k, v = (jnp.repeat(x.reshape(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim), repeats, axis=-2)
            .reshape(*x.shape[:-1], -1) for x in (k, v))
    return fuse_columns([q, k, v], 1)


def replicate_kv_heads(model, tp: int):
    """A model whose k/v projections carry each KV head tp / num_kv_heads times, when there are fewer KV
    heads than shards: every shard then owns the one KV head its query heads read (as vLLM does)."""
    cfg = model.cfg
    if cfg.num_kv_heads % tp == 0 or cfg.mla:  # MLA's one latent head: every shard holds it whole
        return model
    repeats = tp // cfg.num_kv_heads
    log.info("tensor parallel: %d KV heads < %d shards; each KV head is replicated %d times", cfg.num_kv_heads,
             tp, repeats)
    params = model.params()
    qkv = params["layers"]["self_attn"]["qkv_proj"]
    for leaf, value in qkv.items():  # kernel [L, hidden, (Hq + 2 Hkv) * D], bias [L, (Hq + 2 Hkv) * D]
        qkv[leaf] = jax.tree.map(functools.partial(_repeat_kv_columns, cfg=cfg, repeats=repeats), value)
    if cfg.qk_norm_all_heads:  # OLMo 2's k_norm over all KV heads: each head's weights repeated with it (every head
        # repeated alike, the mean square over the repeats is the original's)
        k_norm = params["layers"]["self_attn"]["k_norm"]
        w = k_norm["weight"]
        k_norm["weight"] = jnp.repeat(w.reshape(*w.shape[:-1], cfg.num_kv_heads, cfg.head_dim), repeats,
                                      axis=-2).reshape(*w.shape[:-1], -1)
    return _with_cfg(model, dataclasses.replace(cfg, num_kv_heads=tp), params)


def _with_cfg(model, cfg, params=None):
    """The model rebuilt under `cfg` (its graphdef carries the config) with `params` (default: its own)."""
    graphdef, state = abstract_model(cfg, model.dtype)
    nnx.replace_by_pure_dict(state, model.params() if params is None else params)
    return dataclasses.replace(model, cfg=cfg, graphdef=graphdef, state=state)


def group_fused_projections(model, tp: int):
    """The fused q/k/v and gate/up columns re-laid from one group (as loaded) into one group per shard
    (`fuse_columns`), so that each shard's column slice is its own heads and MLP units."""
    if tp == 1:
        return model
    params = model.params()
    regroup = lambda a, widths, groups: fuse_columns(split_columns(a, widths, 1), groups)  # noqa: E731
    for module, proj, widths in fused_projection_widths(model.cfg):
        groups = fused_groups(widths, tp)
        for stack, *_ in layer_stacks(model.cfg):  # a projection in either stack of layers (DeepSeek has two)
            parent = params[stack]
            for key in module.split("."):
                parent = parent.get(key, {})
            for leaf, value in parent.get(proj, {}).items():
                parent[proj][leaf] = jax.tree.map(  # a QuantizedWeight's leaves alike
                    functools.partial(regroup, widths=widths, groups=groups), value)
    layers = params["layers"]
    cfg = model.cfg
    if cfg.num_experts and not cfg.expert_parallel:  # each shard's units of every expert: its [gate | up]
        experts, units = layers["mlp"]["experts"], (cfg.moe_intermediate_size,) * 2
        for leaf in ("gate_up_proj", "gate_up_proj_bias"):
            if leaf in experts:
                experts[leaf] = regroup(experts[leaf], units, tp)
    state = jax.tree.map(lambda leaf: leaf, model.state)  # a new State: `model` may serve other engines
    nnx.replace_by_pure_dict(state, params)
    return dataclasses.replace(model, state=state)


def shard_model(model, mesh: Mesh, expert_parallel: bool = False):
    """The model's parameters placed on `mesh`: each device receives only its shard of each tensor. An MoE
    model's experts split whole over the devices where `expert_parallel`, else by units (models/moe.py)."""
    tp = mesh.shape[MODEL_AXIS]
    if model.cfg.num_experts and tp > 1:
        model = _with_cfg(model, dataclasses.replace(model.cfg, expert_parallel=expert_parallel))
    check_tensor_parallel(model.cfg, tp)
    model = group_fused_projections(replicate_kv_heads(model, tp), tp)
    params = model.params()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]

    def place(path, leaf):
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        return jax.device_put(leaf, NamedSharding(mesh, param_spec(name, leaf.shape, tp, model.cfg.expert_parallel)))

    placed = jax.tree_util.tree_unflatten(jax.tree.structure(params), [place(p, leaf) for p, leaf in flat])
    state = jax.tree.map(lambda leaf: leaf, model.state)  # a new State: `model` may serve other engines
    nnx.replace_by_pure_dict(state, placed)
    return dataclasses.replace(model, state=state)
