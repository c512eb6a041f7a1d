"""The jitted model steps: the packed int32 buffer in, logits, sampled tokens or pooled hidden states and the updated
cache out."""

import functools

import jax
import jax.numpy as jnp

from engine.worker.packing import StepLayout, unpack
from engine.worker.sampler import sample
from models.transformer import forward


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def model_step(graphdef, state, kv_cache, buf, layout: StepLayout, kernels):
    """Logits of the rows `layout` asks for (tests, scoring)."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    return forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, kernels)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8), donate_argnums=(2,))
def sample_step(graphdef, state, kv_cache, fed, buf, sampling_md, layout: StepLayout, mode: str, kernels):
    """One token per logits row, sampled on the device: only the SampleOutput comes back to the host.
    `mode` "greedy" takes no sampling metadata (None); "full" does penalties, filtering and logprobs.
    A decode step also takes `fed` i32[max rows], the last decode step's tokens (its rows first), where rows
    whose token_source is >= 0 read their input token, and returns its own tokens in the same form; None
    in a prefill step (async scheduling: ModelRunner._dispatch_decodes)."""
    token_ids, positions, md, logits_indices = unpack(buf, layout, fed)
    logits, kv_cache = forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, kernels)
    out = sample(logits, sampling_md, mode=mode)
    if fed is not None:
        fed = jax.lax.dynamic_update_slice(fed, out.tokens.astype(fed.dtype), (0,))
    return out, fed, kv_cache


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9, 10), donate_argnums=(2,))
def prompt_logprobs_step(graphdef, state, kv_cache, buf, sampling_md, next_ids, sample_rows, layout: StepLayout,
                         mode: str, num_top: int, kernels):
    """A prefill step that also scores the prompt: for every token row, the raw logprob of the next
    prompt token (`next_ids`, -1 where there is none) and the top-`num_top` logprobs. The rows in
    `sample_rows` (each chunk's last) are then sampled as in `sample_step`. `layout` asks for the
    logits of every row."""
    token_ids, positions, md, logits_indices = unpack(buf, layout)
    logits, kv_cache = forward(graphdef, state, kv_cache, token_ids, positions, md, logits_indices, kernels)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_ids, 0)[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, num_top)
    return (chosen, top_ids.astype(jnp.int32), top_values), sample(logits[sample_rows], sampling_md,
                                                                   mode=mode), kv_cache


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def pooling_step(graphdef, state, kv_cache, buf, layout: StepLayout, kernels):
    """A prefill step for embeddings: no LM head, no sampler. The final hidden states of every token row (after
    the final norm), float32, summed per sequence (one segment sum over the packed rows, so a call pools many
    sequences), and each sequence's last row: ([num_seqs, hidden], [num_seqs, hidden]). The host adds a request's
    chunks' sums up (mean pooling) or takes its last chunk's last row (last pooling). Padding rows fall past the
    last segment and are dropped."""
    token_ids, positions, md, last_rows = unpack(buf, layout)
    hidden, kv_cache = forward(graphdef, state, kv_cache, token_ids, positions, md, None, kernels, hidden_states=True)
    hidden = hidden.astype(jnp.float32)
    seq_of_row = jnp.searchsorted(md.query_start_loc[1:], jnp.arange(layout.num_tokens), side="right")
    sums = jax.ops.segment_sum(hidden, seq_of_row, num_segments=layout.num_seqs, indices_are_sorted=True)
    return (sums, hidden[last_rows]), kv_cache
