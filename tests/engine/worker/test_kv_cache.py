"""The KV cache's memory budget (engine/worker/kv_cache.py): what it asks the devices, and the pages' size."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from engine.worker.kv_cache import kv_bytes_per_block, num_blocks_for_memory
from models.config import ModelConfig
from pallas_kernels.kernels import Kernels

CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64)
GIB = 1 << 30


@dataclasses.dataclass
class FakeDevice:
    """A TPU device of process `process_index`; jaxlib refuses memory_stats() for another process's device."""
    process_index: int
    platform: str = "tpu"
    asked: int = 0

    def memory_stats(self):
        if self.process_index != jax.process_index():
            raise RuntimeError("memory_stats() of a non-addressable device")
        self.asked += 1
        return {"bytes_limit": 16 * GIB, "bytes_in_use": 4 * GIB}


def test_multihost_asks_its_own_device():
    """A follower's mesh lists process 0's devices first: the budget comes from this process's own device."""
    other, own = FakeDevice(jax.process_index() + 1), FakeDevice(jax.process_index())
    blocks = num_blocks_for_memory(CFG, 16, jnp.bfloat16, 0.5, cap_blocks=10**9, cpu_budget_bytes=GIB,
                                   devices=[other, own])
    assert own.asked == 1
    # half of the 12 GiB free, over 2 devices that each hold half of every block
    assert blocks == (6 * GIB) // (kv_bytes_per_block(CFG, 16, jnp.bfloat16) // 2)


@pytest.mark.parametrize("attention,kv_heads,shards,dtype,page_dims", [
    ("pallas_tpu", 2, 1, jnp.bfloat16, (2, 128)),   # head_dim 64 padded to a lane tile
    ("pallas_tpu", 3, 1, jnp.bfloat16, (4, 128)),   # an odd count of 16-bit heads: one more
    ("pallas_tpu", 4, 4, jnp.bfloat16, (8, 128)),   # one head a shard: two a shard
    ("pallas_tpu", 3, 1, jnp.float32, (3, 128)),    # 32-bit heads are never packed
    ("reference", 3, 1, jnp.bfloat16, (3, 64)),
    ("native", 3, 1, jnp.bfloat16, (3, 64)),
])
def test_pages_padded_only_for_the_tpu_kernel(attention, kv_heads, shards, dtype, page_dims):
    kernels = Kernels("tpu" if attention == "pallas_tpu" else "cpu", attention, native=False)
    assert kernels.kv_page_dims(kv_heads, 64, dtype, shards) == page_dims
    cfg = dataclasses.replace(CFG, num_kv_heads=kv_heads)
    # the budget counts the padded pages
    assert kv_bytes_per_block(cfg, 16, dtype, page_dims) == \
        kv_bytes_per_block(cfg, 16, dtype) * page_dims[0] * page_dims[1] // (kv_heads * 64)
