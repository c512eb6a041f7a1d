"""The worker's KV cache: the device pages every step reads and writes (donated to each step, so this store
holds the latest), host-memory copies of swapped-out requests' blocks, and the cache's memory budget."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.core.block_pool import NULL_BLOCK
from models.config import ModelConfig
from models.mesh import kv_cache_sharding
from models.paged import KVCache, init_kv_cache, kv_cache_groups
from pallas_kernels.kv_quant import page_dim
from pallas_kernels.ops import write_blocks


@jax.jit
def gather_blocks(kv_cache, block_ids):
    """Every slot's pages `block_ids`: ([num_slots, n, ...], [num_slots, n, ...])."""
    return tuple(pages[:, block_ids] for pages in kv_cache)


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def scatter_blocks(kv_cache, block_ids, blocks, native_write: bool):
    # Padded entries of block_ids are the null block: whatever they carry lands there, harmlessly.
    return tuple(write_blocks(pages, block_ids, new, native_write) for pages, new in zip(kv_cache, blocks))


def host_memory_sharding(mesh, replicated: bool = False):
    """The cache's sharding in pinned host memory where every device has it (GPU, TPU, recent CPU), else
    None (numpy: single-process only)."""
    if all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in mesh.devices.flat):
        return kv_cache_sharding(mesh, memory_kind="pinned_host", replicated=replicated)
    return None


def kv_bytes_per_block(cfg, block_size, dtype, page_dims: tuple[int, int] | None = None) -> int:
    """Bytes of one block id over the pool's slots (every layer, or every layer of a KV cache group), K and V
    (MLA: the one latent array), with pages of `page_dims` (KV heads, head dim): default the model's (a quantized
    dtype's rows with their scale: pallas_kernels/kv_quant.py); the TPU pads them (Kernels.kv_page_dims)."""
    arrays, heads, dim = cfg.kv_cache_layout
    heads, dim = page_dims or (heads, page_dim(dim, dtype))
    return arrays * kv_cache_groups(cfg).num_slots * block_size * heads * dim * jnp.dtype(dtype).itemsize


def memory_stats_device(devices):
    """The device to ask for memory statistics: the first of `devices` this process can address (jaxlib refuses
    another process's device), or None."""
    return next((d for d in devices if d.process_index == jax.process_index()), None)


def num_blocks_for_memory(cfg, block_size, dtype, memory_fraction: float, cap_blocks: int,
                          cpu_budget_bytes: int, devices=None, page_dims: tuple[int, int] | None = None) -> int:
    """KV blocks that fit in `memory_fraction` of an accelerator's free memory, or on CPU (or a
    device that reports no memory) in `cpu_budget_bytes`: a fixed budget, as vLLM's CPU backend, not a
    share of host RAM (gigabytes of zeros to allocate for a small model). At most
    `cap_blocks`: more than every sequence at full length could use is waste. Over `devices` (tensor
    parallel), each holds 1/len(devices) of every block, so an accelerator's budget is per device."""
    devices = devices or jax.devices()[:1]
    device = memory_stats_device(devices)
    stats = (device.memory_stats() or {}) if device is not None and device.platform != "cpu" else {}
    block_bytes = kv_bytes_per_block(cfg, block_size, dtype, page_dims)
    if "bytes_limit" in stats:
        budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * memory_fraction)
        block_bytes //= len(devices)
    else:
        budget = cpu_budget_bytes
    return max(2, min(budget // block_bytes, cap_blocks))


class KVCacheStore:
    """The device pages (k and v, each [num_slots, num_blocks, block_size, num_kv_heads, head_dim], the last two
    padded on a TPU: Kernels.kv_page_dims) and the host copies of swapped-out requests' blocks, by request id.
    Each step donates `pages` and puts back its output. `buckets`: the padded block counts a swap copy takes (each
    compiles once)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh, swap_buckets: tuple[int, ...],
                 native_write: bool, page_dims: tuple[int, int] | None = None):
        """`page_dims`: the pages' (KV heads, head dim) (Kernels.kv_page_dims; default the model's, with a
        quantized dtype's scale)."""
        arrays, heads, dim = cfg.kv_cache_layout
        heads, dim = page_dims or (heads, page_dim(dim, dtype))
        self.device_sharding = kv_cache_sharding(mesh, replicated=cfg.mla)
        # Committed to the devices from the start: every later cache (step or swap output) is too, so the jitted
        # step sees one input placement and compiles each shape once. Zeros made in place on each device: no full
        # copy of the cache anywhere.
        self.pages: KVCache = jax.jit(
            functools.partial(init_kv_cache, kv_cache_groups(cfg).num_slots, num_blocks, block_size, heads, dim, dtype,
                              arrays),
            out_shardings=(self.device_sharding,) * arrays)()
        self.host_sharding = host_memory_sharding(mesh, replicated=cfg.mla)
        self.swap_buckets = swap_buckets
        self.native_write = native_write  # swap-ins through the native row write (one CPU device)
        self.swapped: dict[str, tuple] = {}  # request id -> its swapped-out blocks, in host memory

    @property
    def lost(self) -> bool:
        """True when a failed jitted call had already consumed the donated pages: nothing can go on."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.pages))

    def shapes(self) -> KVCache:
        """The pages as ShapeDtypeStructs (what compiles against them, while steps donate the real ones)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.pages)

    def _padded_ids(self, ids) -> np.ndarray:
        size = next((n for n in self.swap_buckets if n >= len(ids)), None)
        if size is None:
            raise ValueError(f"{len(ids)} blocks exceed the largest swap copy {self.swap_buckets[-1]}")
        out = np.full(size, NULL_BLOCK, np.int32)
        out[:len(ids)] = ids
        return out

    def swap_out(self, req_id: str, block_ids: list[int]) -> None:
        """Copy a request's device blocks to host memory, kept until its swap-in (or its finish)."""
        blocks = gather_blocks(self.pages, self._padded_ids(block_ids))
        if self.host_sharding is not None:
            blocks = jax.device_put(blocks, self.host_sharding)
        else:
            blocks = jax.tree.map(np.asarray, blocks)
        self.swapped[req_id] = blocks

    def swap_in(self, req_id: str, block_ids: list[int]) -> None:
        """Write a request's host copy into device blocks `block_ids` (as many as it swapped out), and drop it."""
        blocks = jax.device_put(self.swapped.pop(req_id), self.device_sharding)
        self.pages = scatter_blocks(self.pages, self._padded_ids(block_ids), blocks, self.native_write)

    def drop(self, req_id: str) -> None:
        """A swapped-out request finished (was aborted): forget its host copy."""
        self.swapped.pop(req_id, None)

    def compile_swaps(self, pages: KVCache) -> None:
        """The swap copies of every size, ahead of time against `pages`' shapes (warm_swaps runs them instead:
        it must not run beside the steps, which donate the pages)."""
        for n in self.swap_buckets:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            blocks = tuple(jax.ShapeDtypeStruct((p.shape[0], n, *p.shape[2:]), p.dtype,
                                                sharding=self.device_sharding) for p in pages)
            # No mesh context, as swap_out and swap_in call them: it is part of what a program is keyed by.
            gather_blocks.lower(pages, ids).compile()
            scatter_blocks.lower(pages, ids, blocks, self.native_write).compile()

    def warm_swaps(self) -> None:
        """Run a swap copy of every size on the null block (its contents are never read)."""
        for n in self.swap_buckets:
            self.swap_out("", [NULL_BLOCK] * n)
            self.swap_in("", [NULL_BLOCK] * n)
