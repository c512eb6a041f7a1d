"""The jitted model steps: the packed int32 buffer in, logits or sampled tokens and the updated cache out."""

import functools

import jax
import jax.numpy as jnp

from engine.packing import StepLayout, unpack
from engine.sampler import sample
from models.transformer import forward


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def model_step(graphdef, state, kv_cache, buf, layout: StepLayout, attention_impl=None):
    """Logits of the rows `layout` asks for (tests, scoring)."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    return forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, attention_impl)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7), donate_argnums=(2,))
def sample_step(graphdef, state, kv_cache, buf, sampling_md, layout: StepLayout, mode: str, attention_impl=None):
    """One token per logits row, sampled on the device: only the SampleOutput comes back to the host.
    `mode` "greedy" takes no sampling metadata (None); "full" does penalties, filtering and logprobs."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    logits, kv_cache = forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, attention_impl)
    return sample(logits, sampling_md, mode=mode), kv_cache


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9, 10), donate_argnums=(2,))
def prompt_logprobs_step(graphdef, state, kv_cache, buf, sampling_md, next_ids, sample_rows, layout: StepLayout,
                         mode: str, num_top: int, attention_impl=None):
    """A prefill step that also scores the prompt: for every token row, the raw logprob of the next
    prompt token (`next_ids`, -1 where there is none) and the top-`num_top` logprobs. The rows in
    `sample_rows` (each chunk's last) are then sampled as in `sample_step`. `layout` asks for the
    logits of every row."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    logits, kv_cache = forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, attention_impl)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_ids, 0)[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, num_top)
    return (chosen, top_ids.astype(jnp.int32), top_values), sample(logits[sample_rows], sampling_md, mode=mode), kv_cache
