"""The jitted model step: the packed int32 buffer in, logits and the updated cache out."""

import functools

import jax

from engine.packing import StepLayout, unpack
from models.transformer import forward


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def model_step(graphdef, state, kv_cache, buf, layout: StepLayout, attention_impl=None):
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    return forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, attention_impl)
