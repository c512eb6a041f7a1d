"""The TPU kernel's page layout, without Pallas (pallas_kernels/kernels.py sizes the KV cache with it on any host)."""

import jax.numpy as jnp

LANES = 128  # a TPU vreg is 8 sublanes x 128 lanes


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def page_head_dim(head_dim: int) -> int:
    """The last dim of the pages the TPU kernel reads: head_dim padded to whole lane tiles."""
    return round_up(head_dim, LANES)


def page_kv_heads(num_kv_heads: int, dtype) -> int:
    """The KV heads a (per-shard) TPU page holds: rounded up to the dtype's sublane packing (2 for 16-bit)."""
    return round_up(num_kv_heads, max(1, 4 // jnp.dtype(dtype).itemsize))
