"""The device mesh: its one axis ("model", tensor parallelism), the shardings on it, and the fused
projections' per-shard column layout. A leaf: the model and the engine both build on it."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"
# [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: each device holds its KV heads' pages.
KV_CACHE_SPEC = P(None, None, None, MODEL_AXIS, None)
# [num_layers * num_blocks, block_size, num_kv_heads, head_dim]: the same, as the layer loop's pool.
KV_POOL_SPEC = P(None, None, MODEL_AXIS, None)
# [tokens, heads, head_dim] activations entering and leaving the per-shard attention.
HEADS_SPEC = P(None, MODEL_AXIS, None)


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


def kv_cache_sharding(mesh: Mesh, memory_kind: str | None = None, replicated: bool = False) -> NamedSharding:
    """The KV pages' sharding: by KV heads, or `replicated` (MLA's one latent head, which every shard reads)."""
    return NamedSharding(mesh, P() if replicated else KV_CACHE_SPEC, memory_kind=memory_kind)
