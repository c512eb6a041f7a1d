"""The paged KV cache and the per-step attention metadata the model reads it through."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

# (k_pages, v_pages), each [num_slots, num_blocks, block_size, num_kv_heads, head_dim] ((latent_pages,) for MLA,
# models/mla.py): one array per side for
# every layer (KVCacheGroups: a slot per layer, or per layer of a group), so the layer loop is a scan and the step
# donates two buffers, not 2 x layers. On a TPU the last two dims are padded (Kernels.kv_page_dims).
KVCache = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about this step, as one explicit pytree of int32 arrays. The step's, over G
    KV cache groups (KVCacheGroups), and a layer's (`for_layer`), over its group's blocks:

    slot_mapping    [G, T] / [T]  cache slot (block * block_size + offset) each token's K/V goes to;
                                  padding tokens point into the null block.
    block_tables    [S, W * G] / [S, W]  each sequence's pages in order, group-minor (entry i * G + g: logical
                                  block i of group g); padding entries are the null block.
    context_lens    [S]      tokens of the sequence in the cache after this step; 0 for padding rows.
    query_start_loc [S + 1]  sequence s owns token rows [query_start_loc[s], query_start_loc[s + 1]).
    sliding_window  a layer's: None (no layer has one), or int32 [] (0: this layer has none)
    decode          (static) every sequence has exactly one query token at row s.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    sliding_window: jax.Array | None = None
    decode: bool = False

    def for_layer(self, layer, num_blocks: int, block_size: int, groups: "KVCacheGroups") -> "AttentionMetadata":
        """The step seen by `layer` (int32 [], traced in the layer scan) in the pool's pages laid end to end
        ([num_slots * num_blocks, ...], see `layer_pool`): its group's slots and table, its blocks offset by its
        slot * num_blocks (padding then points at its slot's own null block), its group's window."""
        num_groups = groups.num_groups
        if num_groups == 1:
            slot, group, tables = layer, 0, self.block_tables
        else:
            slot, group = jnp.asarray(groups.layer_slot)[layer], jnp.asarray(groups.layer_group)[layer]
            num_seqs = self.block_tables.shape[0]
            tables = jax.lax.dynamic_index_in_dim(self.block_tables.reshape(num_seqs, -1, num_groups), group,
                                                  axis=2, keepdims=False)
        offset = slot * num_blocks
        window = None if not any(groups.windows) else jnp.asarray(groups.windows, jnp.int32)[group]
        return dataclasses.replace(self, slot_mapping=self.slot_mapping[group] + offset * block_size,
                                   block_tables=tables + offset, sliding_window=window)

    def last_rows_queried(self) -> "AttentionMetadata":
        """The same step with one query per sequence, its last token's (the row its logits come from): decode
        metadata over the same pages and lengths. slot_mapping stays [T], for every row's K/V write."""
        num_seqs = self.context_lens.shape[0]
        return dataclasses.replace(self, query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32), decode=True)


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "context_lens", "query_start_loc", "sliding_window"],
    meta_fields=["decode"],
)


def init_kv_cache(num_slots, num_blocks, block_size, num_kv_heads, head_dim, dtype, arrays: int = 2) -> KVCache:
    """Zeroed pages: K and V, or (MLA: arrays=1) the one latent array."""
    shape = (num_slots, num_blocks, block_size, num_kv_heads, head_dim)
    return tuple(jnp.zeros(shape, dtype) for _ in range(arrays))


def cache_page_dims(cfg, kernels, dtype, shards: int = 1) -> tuple[int, int]:
    """(heads, head dim) of the pages' rows for the model (ModelConfig.kv_cache_layout) on `kernels`' platform
    (Kernels.kv_page_dims), over `shards` tensor-parallel devices; MLA's one latent head is held whole by each."""
    _, heads, dim = cfg.kv_cache_layout
    return kernels.kv_page_dims(heads, dim, dtype, 1 if cfg.mla else shards)


def layer_pool(pages: jax.Array) -> jax.Array:
    """[num_slots, num_blocks, ...] -> [num_slots * num_blocks, ...]: every slot's pages as one pool (a free reshape),
    which the attention kernels read through per-layer offset block tables (AttentionMetadata.for_layer)."""
    return pages.reshape(pages.shape[0] * pages.shape[1], *pages.shape[2:])

@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheGroups:
    """How the layers share the KV pool (vLLM's hybrid KV cache groups). Layers of one attention type (full, or
    one sliding window) form groups of at most `num_slots` layers; the pool has `num_slots` pages per block id
    ([num_slots, num_blocks, ...]), and a layer reads the pages of its slot through its group's block table. A
    request holds a block id per group for each of its logical blocks, in one list, group-minor: logical block
    i of group g is its entry i * num_groups + g. So a sliding group's blocks behind its window can go back to
    the pool while the full-attention groups keep theirs: memory per request is the context on full layers and
    the window on sliding ones. Every layer of one type: one group of all the layers (the plain layout)."""

    windows: tuple[int, ...]      # per group: its layers' sliding window (0: full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]   # per layer: its index in the pool's leading axis

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1

    @property
    def sliding(self) -> tuple[int, ...]:
        """The groups with a window."""
        return tuple(g for g, w in enumerate(self.windows) if w)

    @classmethod
    def for_windows(cls, layer_windows: tuple[int, ...]) -> "KVCacheGroups":
        """Groups as large as the rarest attention type's layer count (vLLM's rule: the fewest pages per
        block that no type leaves idle, but the last group of a type that does not divide evenly)."""
        by_window: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in by_window.values())
        windows, layer_group, layer_slot = [], [0] * len(layer_windows), [0] * len(layer_windows)
        for window, layers in sorted(by_window.items()):
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot))


@functools.cache
def kv_cache_groups(cfg) -> KVCacheGroups:
    """The KV cache groups of a ModelConfig's layers."""
    return KVCacheGroups.for_windows(cfg.layer_windows)
