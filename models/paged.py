"""The paged KV cache and the per-step attention metadata the model reads it through."""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import native

NULL_BLOCK = 0  # reserved: padding tokens write here and block tables pad with it

# (k_pages, v_pages), each [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: one array per
# side for every layer, so the layer loop is a scan and the step donates two buffers, not 2 x layers.
KVCache = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about this step, as one explicit pytree of int32 arrays.

    slot_mapping    [T]      cache slot (block * block_size + offset) each token's K/V goes to;
                             padding tokens point into the null block.
    block_tables    [S, W]   each sequence's pages in order; padding entries are the null block.
    context_lens    [S]      tokens of the sequence in the cache after this step; 0 for padding rows.
    query_start_loc [S + 1]  sequence s owns token rows [query_start_loc[s], query_start_loc[s + 1]).
    decode          (static) every sequence has exactly one query token at row s.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    decode: bool = False

    def for_layer(self, layer, num_blocks: int, block_size: int) -> "AttentionMetadata":
        """The same step seen by `layer` in the layers' pages laid end to end ([L * num_blocks, ...],
        see `layer_pool`): its blocks are offset by layer * num_blocks. Padding then points at that
        layer's own null block."""
        offset = layer * num_blocks
        return dataclasses.replace(self, slot_mapping=self.slot_mapping + offset * block_size,
                                   block_tables=self.block_tables + offset)

    def last_rows_queried(self) -> "AttentionMetadata":
        """The same step with one query per sequence, its last token's (the row its logits come from): decode
        metadata over the same pages and lengths. slot_mapping stays [T], for every row's K/V write."""
        num_seqs = self.context_lens.shape[0]
        return dataclasses.replace(self, query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32), decode=True)


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "context_lens", "query_start_loc"],
    meta_fields=["decode"],
)


def init_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype) -> KVCache:
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def layer_pool(pages: jax.Array) -> jax.Array:
    """[L, num_blocks, ...] -> [L * num_blocks, ...]: every layer's pages as one pool (a free reshape),
    which the attention kernels read through per-layer offset block tables (AttentionMetadata.for_layer)."""
    return pages.reshape(pages.shape[0] * pages.shape[1], *pages.shape[2:])


def write_blocks(pages, block_ids, blocks, native_write: bool):
    """pages [L, NB, BS, ...] with pages[:, block_ids] = blocks [L, n, BS, ...] (a swap-in). `native_write`
    (CPU): the native row write, in place. XLA CPU widens a 16-bit float scatter (or update) to float32
    over the whole pool: 1.4 s per swap-in of a bf16 cache of 16k blocks (float32: 1.3 ms)."""
    if not native_write:
        return pages.at[:, block_ids].set(blocks)
    num_layers, num_blocks, block_size = pages.shape[:3]
    first_rows = (jnp.arange(num_layers)[:, None] * num_blocks + block_ids[None, :]) * block_size  # [L, n]
    slots = (first_rows[:, :, None] + jnp.arange(block_size)).reshape(-1)
    return native.kv_write(pages, blocks.reshape(-1, *pages.shape[3:]), slots)


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter this step's k/v [T, Hkv, D] into their slots. Under a donated cache XLA does it in place."""
    if jax.default_backend() == "cpu" and native.available():
        # XLA CPU copies the whole pool (every layer's pages, per layer and step) where its scatter is
        # not in place: a 16-bit float scatter is widened to float32 (5x slower decode at 4 layers),
        # and a one-token step's scatter becomes a dynamic-update-slice behind a copy of the pool
        # (batch-1 decode). The native write copies only the T rows, in place.
        return native.kv_write(k_pages, k, slot_mapping), native.kv_write(v_pages, v, slot_mapping)
    num_blocks, block_size = k_pages.shape[:2]

    def write(pages, new):
        flat = pages.reshape(num_blocks * block_size, *pages.shape[2:])
        flat = flat.at[slot_mapping].set(new.astype(pages.dtype), mode="drop", unique_indices=False)
        return flat.reshape(pages.shape)

    return write(k_pages, k), write(v_pages, v)
