"""Plain-jnp paged attention: the CPU default and the oracle the kernels are tested against.

Layouts (shared with the Pallas kernels):
  q            [T, num_q_heads, head_dim]        one row per query token
  k_pages      [num_blocks, block_size, num_kv_heads, head_dim]   (v_pages the same)
  block_tables [S, W] int32   page ids of each sequence, in order; unused entries may hold anything
  context_lens [S] int32      tokens of each sequence in the cache, this step's included; 0 = padding row
  query_start_loc [S + 1] int32  (prefill) sequence s owns query rows [qsl[s], qsl[s+1])

A query's absolute position is context_len - query_len + its index in the chunk; it attends to
keys at positions <= its own (causal) and, under a sliding window W > 0, to the last W of them (positions
> its own - W, as transformers masks). Rows that attend to nothing (padding) come out as zeros.

sinks: None, or float32 [num_q_heads]: attention sinks (gpt-oss), a learned logit per query head that joins the
softmax's denominator and adds no value: with m = max(max_j s_j, sink[h]),
out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink[h] - m)). A row that sees no key is still zeros.

sliding_window: None (no window) or an int32 scalar, a Python int or a traced per-layer value: 0 = no window.
Block-table entries wholly before a query's window may hold anything (the KV cache manager frees those
blocks); kernels must not read them.
Softmax runs in float32; the output has q's dtype. Quantized pages (int8, float8_e4m3fn: each row the head's
values then its float32 scale, pallas_kernels/kv_quant.py) are read as value * scale in float32.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import read_pages

_MASKED = -1e30  # finite, so fully masked rows give exp() == 0 instead of NaN


def _gather_pages(pages, block_table):
    """[num_blocks, bs, H, D] gathered through one table row -> [W * bs, H, D]; quantized pages
    ([..., D + 4] int8 or float8_e4m3fn, pallas_kernels/kv_quant.py) dequantized to float32 [W * bs, H, D]."""
    gathered = pages[block_table]
    return read_pages(gathered.reshape(-1, *pages.shape[2:]))


def _attend(q, k, v, key_mask, scale, soft_cap, sinks=None):
    """q [Q, Hq, D], k/v [L, Hkv, D], key_mask [Q, L] -> [Q, Hq, D] (float32); sinks None or [Hq]."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(q.shape[0], num_kv_heads, group, q.shape[2])
    scores = jnp.einsum("qhgd,lhd->hgql", qg, k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(key_mask[None, None], scores, _MASKED)
    row_max = scores.max(axis=-1, keepdims=True)
    if sinks is not None:  # [Hkv, group, 1, 1]: the sink is one more logit of every row, with no value
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    probs = jnp.where(key_mask[None, None], jnp.exp(scores - row_max), 0.0)
    denom = probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    probs = probs / jnp.where(denom == 0.0, 1.0, denom)
    # Zero the values no row may attend to: a probability of 0 times garbage (NaN/inf) in an
    # unused page slot would otherwise still poison the sum.
    v = jnp.where(key_mask.any(axis=0)[:, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("hgql,lhd->qhgd", probs, v)
    return out.reshape(q.shape[0], num_q_heads, q.shape[2])


def in_window(k_pos, q_pos, sliding_window):
    """Whether keys at k_pos are inside the sliding window of queries at q_pos (broadcast)."""
    if sliding_window is None:
        return True
    w = jnp.asarray(sliding_window, jnp.int32)
    return (w <= 0) | (k_pos > q_pos - w)


def paged_decode_attention_ref(q, k_pages, v_pages, block_tables, context_lens, *, scale, soft_cap=None,
                               sliding_window=None, sinks=None):
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D]."""

    def one_sequence(q_s, table, ctx_len):
        k = _gather_pages(k_pages, table)
        v = _gather_pages(v_pages, table)
        k_pos = jnp.arange(k.shape[0])
        key_mask = ((k_pos < ctx_len) & in_window(k_pos, ctx_len - 1, sliding_window))[None, :]
        return _attend(q_s[None], k, v, key_mask, scale, soft_cap, sinks)[0]

    out = jax.vmap(one_sequence)(q, block_tables, context_lens)
    return out.astype(q.dtype)


def paged_prefill_attention_ref(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *, scale, soft_cap=None, sliding_window=None,
    sinks=None,
):
    """Flat query tokens of several sequences: q [T, Hq, D] -> [T, Hq, D].

    Scans the sequences in order; each takes a window of T rows starting at its first query
    (rows past its own chunk are masked and rewritten by the next sequence), so memory stays
    at one sequence's [T, context] scores.
    """
    num_tokens = q.shape[0]
    q_padded = jnp.concatenate([q, jnp.zeros_like(q)], axis=0)
    out0 = jnp.zeros((2 * num_tokens, *q.shape[1:]), jnp.float32)
    rows = jnp.arange(num_tokens)

    def one_sequence(out, xs):
        table, ctx_len, start, end = xs
        q_len = end - start
        q_s = jax.lax.dynamic_slice_in_dim(q_padded, start, num_tokens)
        k = _gather_pages(k_pages, table)
        v = _gather_pages(v_pages, table)
        q_pos = ctx_len - q_len + rows  # absolute position of each window row
        k_pos = jnp.arange(k.shape[0])
        key_mask = ((k_pos[None, :] <= q_pos[:, None]) & (rows < q_len)[:, None]
                    & in_window(k_pos[None, :], q_pos[:, None], sliding_window))
        o = _attend(q_s, k, v, key_mask, scale, soft_cap, sinks)
        # Only this sequence's rows: leave rows beyond the chunk as they were.
        current = jax.lax.dynamic_slice_in_dim(out, start, num_tokens)
        o = jnp.where((rows < q_len)[:, None, None], o, current)
        return jax.lax.dynamic_update_slice_in_dim(out, o, start, axis=0), None

    xs = (block_tables, context_lens, query_start_loc[:-1], query_start_loc[1:])
    out, _ = jax.lax.scan(one_sequence, out0, xs)
    return out[:num_tokens].astype(q.dtype)
