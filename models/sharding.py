"""Tensor parallelism: a one-axis device mesh, Megatron-style parameter shardings, and the KV cache
sharded over KV heads. XLA's SPMD partitioner does the rest (the all-reduces after o_proj and
down_proj, the vocabulary-sharded embedding and LM head); the attention kernels are custom calls it
cannot see into, so `Attention` runs them per shard under `jax.shard_map` (see `model_axis_size`).
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger("ferry")

MODEL_AXIS = "model"
# [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: each device holds its KV heads' pages.
KV_CACHE_SPEC = P(None, None, None, MODEL_AXIS, None)
# [num_layers * num_blocks, block_size, num_kv_heads, head_dim]: the same, as the layer loop's pool.
KV_POOL_SPEC = P(None, None, MODEL_AXIS, None)
# [tokens, heads, head_dim] activations entering and leaving the per-shard attention.
HEADS_SPEC = P(None, MODEL_AXIS, None)

# Parameter name suffix -> the axis (counted from the end) split over the model axis.
# Column-parallel (output features = heads or MLP units): the fused q/k/v and gate/up projections
# (laid out shard by shard, see `fuse_columns`); row-parallel (input features): o, down, whose partial
# sums XLA all-reduces; the vocabulary: embedding rows, LM head columns.
_SPLIT_AXIS = {
    "qkv_proj.kernel": -1, "qkv_proj.bias": -1, "gate_up_proj.kernel": -1, "gate_up_proj.bias": -1,
    "o_proj.kernel": -2, "down_proj.kernel": -2,
    "embed_tokens.embedding": -2, "lm_head.kernel": -1,
}


def make_mesh(devices) -> Mesh:
    """A mesh whose one axis, "model", spans `devices` (Auto axes: XLA propagates the shardings)."""
    return Mesh(np.asarray(devices), (MODEL_AXIS,), axis_types=(AxisType.Auto,))


def engine_devices(tp: int, devices=None) -> list:
    """The devices one engine (one model replica) runs on: `devices`, or the first `tp`."""
    devices = list(jax.devices()[:tp] if devices is None else devices)
    if len(devices) != tp:
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; got {len(devices)} of the "
                         f"{jax.device_count()} {jax.default_backend()} devices")
    return devices


def loading_device(mesh: Mesh):
    """Where a checkpoint is read before `shard_model` places it: the host when the model is split or
    not on the default device (no accelerator holds a full copy), else that device."""
    devices = list(mesh.devices.flat)
    if devices == jax.devices()[:1]:
        return devices[0]
    return jax.local_devices(backend="cpu")[0]


def model_axis_size() -> int:
    """How many shards the model axis of the mesh being traced under has (`jax.set_mesh`); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(MODEL_AXIS, 1)


def fused_groups(widths: tuple[int, ...], tp: int) -> int:
    """How many shard-sized groups a fused projection of parts `widths` is laid out in: one per shard
    when every part splits evenly (each shard's columns are then its own q, k, v or gate, up), else one."""
    return tp if all(w % tp == 0 for w in widths) else 1


def fuse_columns(parts, groups: int):
    """Arrays [..., w_i] -> [..., sum(w_i)] laid out as `groups` blocks, each holding its 1/groups slice
    of every part in order: [q0 k0 v0 | q1 k1 v1 | ...]. A column split over `groups` shards hands each
    shard whole parts of its own. groups=1: a plain concatenation."""
    lead = parts[0].shape[:-1]
    blocks = [p.reshape(*lead, groups, p.shape[-1] // groups) for p in parts]
    return jnp.concatenate(blocks, axis=-1).reshape(*lead, -1)


def split_columns(fused, widths: tuple[int, ...], groups: int) -> list:
    """The inverse of `fuse_columns`: [..., sum(widths)] -> the parts [..., w_i]."""
    lead = fused.shape[:-1]
    blocks = fused.reshape(*lead, groups, -1)
    bounds = np.cumsum([w // groups for w in widths])[:-1].tolist()
    return [b.reshape(*lead, w) for b, w in zip(jnp.split(blocks, bounds, axis=-1), widths)]


def check_tensor_parallel(cfg, tp: int) -> None:
    """Attention splits by query heads, and each shard must own whole KV heads (or one replica of one)."""
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} must divide, or be a multiple of, the model's "
                         f"{cfg.num_kv_heads} KV heads")


def param_spec(name: str, shape: tuple[int, ...], tp: int) -> P:
    """The PartitionSpec of parameter `name` (dotted, e.g. "layers.mlp.up_proj.kernel"); replicated
    where no rule applies or the split axis does not divide evenly (logged)."""
    axis = next((a for suffix, a in _SPLIT_AXIS.items() if name.endswith(suffix)), None)
    if axis is None or tp == 1:
        return P()
    if shape[axis] % tp:
        log.warning("tensor parallel: %s %s is replicated (%d does not split %d ways)", name, shape, shape[axis], tp)
        return P()
    spec = [None] * len(shape)
    spec[axis] = MODEL_AXIS
    return P(*spec)


def replicate_kv_heads(model, tp: int):
    """A model whose k/v projections carry each KV head tp / num_kv_heads times, when there are fewer KV
    heads than shards: every shard then owns the one KV head its query heads read (as vLLM does)."""
    from models.loading import abstract_model  # noqa: PLC0415 (models.transformer imports this module)
    from models.transformer import qkv_widths  # noqa: PLC0415

    cfg = model.cfg
    if cfg.num_kv_heads % tp == 0:
        return model
    repeats = tp // cfg.num_kv_heads
    log.info("tensor parallel: %d KV heads < %d shards; each KV head is replicated %d times", cfg.num_kv_heads,
             tp, repeats)
    params = model.params()
    qkv = params["layers"]["self_attn"]["qkv_proj"]
    for leaf, value in qkv.items():  # kernel [L, hidden, (Hq + 2 Hkv) * D], bias [L, (Hq + 2 Hkv) * D]
        q, k, v = split_columns(value, qkv_widths(cfg), 1)
        k, v = (jnp.repeat(x.reshape(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim), repeats, axis=-2)
                .reshape(*x.shape[:-1], -1) for x in (k, v))
        qkv[leaf] = fuse_columns([q, k, v], 1)
    new_cfg = dataclasses.replace(cfg, num_kv_heads=tp)
    graphdef, state = abstract_model(new_cfg, model.dtype)
    nnx.replace_by_pure_dict(state, params)
    return dataclasses.replace(model, cfg=new_cfg, graphdef=graphdef, state=state)


def group_fused_projections(model, tp: int):
    """The fused q/k/v and gate/up columns re-laid from one group (as loaded) into one group per shard
    (`fuse_columns`), so that each shard's column slice is its own heads and MLP units."""
    from models.transformer import fused_projection_widths  # noqa: PLC0415

    if tp == 1:
        return model
    params = model.params()
    layers = params["layers"]
    for module, proj, widths in fused_projection_widths(model.cfg):
        groups = fused_groups(widths, tp)
        for leaf, value in layers[module][proj].items():
            layers[module][proj][leaf] = fuse_columns(split_columns(value, widths, 1), groups)
    state = jax.tree.map(lambda leaf: leaf, model.state)  # a new State: `model` may serve other engines
    nnx.replace_by_pure_dict(state, params)
    return dataclasses.replace(model, state=state)


def shard_model(model, mesh: Mesh):
    """The model's parameters placed on `mesh`: each device receives only its shard of each tensor."""
    tp = mesh.shape[MODEL_AXIS]
    check_tensor_parallel(model.cfg, tp)
    model = group_fused_projections(replicate_kv_heads(model, tp), tp)
    params = model.params()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]

    def place(path, leaf):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        return jax.device_put(leaf, NamedSharding(mesh, param_spec(name, leaf.shape, tp)))

    placed = jax.tree_util.tree_unflatten(jax.tree.structure(params), [place(p, leaf) for p, leaf in flat])
    state = jax.tree.map(lambda leaf: leaf, model.state)  # a new State: `model` may serve other engines
    nnx.replace_by_pure_dict(state, placed)
    return dataclasses.replace(model, state=state)


def kv_cache_sharding(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, KV_CACHE_SPEC, memory_kind=memory_kind)
