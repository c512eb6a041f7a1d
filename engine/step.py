"""The jitted model step: the packed int32 buffer in, logits (or sampled tokens) and the updated cache out."""

import functools

import jax
import jax.numpy as jnp

from engine.packing import StepLayout, unpack
from models.transformer import forward


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def model_step(graphdef, state, kv_cache, buf, layout: StepLayout, attention_impl=None):
    """Logits of the rows `layout` asks for (tests, prompt logprobs)."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    return forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, attention_impl)


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def greedy_step(graphdef, state, kv_cache, buf, layout: StepLayout, attention_impl=None):
    """Greedy tokens, chosen on the device: only [num_logits] int32 come back to the host."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    logits, kv_cache = forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, attention_impl)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_cache
