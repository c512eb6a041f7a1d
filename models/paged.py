"""The paged KV cache and the per-step attention metadata the model reads it through."""

import dataclasses

import jax
import jax.numpy as jnp

# (k_pages, v_pages), each [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: one array per
# side for every layer, so the layer loop is a scan and the step donates two buffers, not 2 x layers. On a TPU
# the last two dims are padded (pallas_kernels.kernels.Kernels.kv_page_dims).
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
