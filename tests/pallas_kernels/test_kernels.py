"""Pallas paged-attention kernels (interpret mode, CPU) against the plain-jnp references.

Inputs, seeds and checks come from tests/helpers/attention_cases.py (shuffled block tables, NaN in every
cache slot no sequence owns). In addition, in interpret mode the kernels start from NaN-filled
output buffers (aliased into the pallas_call), so an output element a kernel never writes fails the
finiteness check, and rows that attend to nothing (context 0, prefill padding) must come out exactly
zero.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention_cases import (
    PREFILL_CASES,
    WINDOW_PREFILLS,
    assert_zero_rows,
    check_close,
    check_prefill,
    check_window_decode,
    check_window_prefill,
    check_window_through_dispatch,
    decode_inputs,
    make_cache,
    prefill_batch,
    prefill_inputs,
    random_q,
    random_sinks,
    under_layer_scan,
)
from pallas_kernels.attention import paged_attention
from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from pallas_kernels.triton import decode as decode_mod
from pallas_kernels.triton import prefill as prefill_mod
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.prefill import paged_prefill_attention

# ----------------------------------------------------------------------------- decode

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, num_splits)
DECODE_CASES = [
    (2, 2, 64, 8, jnp.float32, None, 1),       # MHA, group 1
    (4, 2, 80, 16, jnp.bfloat16, 30.0, 1),     # group 2, head_dim 80
    (8, 2, 128, 32, jnp.float32, 5.0, 3),      # group 4, split-K (3 splits), soft cap
    (8, 1, 256, 16, jnp.bfloat16, None, 2),    # MQA, group 8, head_dim 256, split-K
    (7, 1, 96, 8, jnp.float32, 10.0, 4),       # MQA, group 7 (not a power of two), head_dim 96
    (16, 2, 64, 128, jnp.bfloat16, None, 1),   # group 8, block_size 128
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,splits", DECODE_CASES)
def test_decode_matches_reference(seed, hq, hkv, d, bs, dtype, cap, splits):
    rng = np.random.default_rng(seed)
    # context 0 (padding row), 1, one full page, one page + 1, several pages, random.
    ctx = [0, 1, bs, bs + 1, 5 * bs + 3, int(rng.integers(1, 4 * bs))]
    q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=bs, dtype=dtype)
    scale = d ** -0.5
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale, soft_cap=cap)
    out = paged_decode_attention(q, k, v, tables, lens, scale=scale, soft_cap=cap,
                                 num_splits=splits, interpret=True)
    check_close(out, ref, dtype, seed, f"decode splits={splits}")
    assert_zero_rows(out, 0, "context-0 row", seed)


def test_decode_through_dispatch(seed):
    """impl="pallas_interpret" reaches the kernel; split-K with more splits than pages."""
    rng = np.random.default_rng(seed)
    q, k, v, tables, lens = decode_inputs(rng, [3 * 8 + 5, 0, 8, 1], num_q_heads=8, num_kv_heads=2,
                                          head_dim=64, block_size=8, dtype=jnp.float32)
    ref = paged_attention(q, k, v, tables, lens, None, decode=True, scale=0.125, impl="reference")
    out = paged_attention(q, k, v, tables, lens, None, decode=True, scale=0.125,
                          impl="pallas_interpret")
    check_close(out, ref, jnp.float32, seed, "decode dispatch")
    # 8 splits over at most 4 pages: most splits are empty and must contribute nothing.
    out = paged_decode_attention(q, k, v, tables, lens, scale=0.125, num_splits=8,
                                 pages_per_step=2, interpret=True)
    check_close(out, ref, jnp.float32, seed, "decode 8 splits")


# ----------------------------------------------------------------------------- prefill

@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", PREFILL_CASES)
def test_prefill_matches_reference(seed, hq, hkv, d, bs, dtype, cap):
    rng = np.random.default_rng(seed)
    prefixes, chunks = zip(*prefill_batch(bs))
    # Small query tiles (16 rows) so long chunks span several tiles.
    group_padded = 1 << (hq // hkv - 1).bit_length()
    kernel = functools.partial(paged_prefill_attention, block_q=max(1, 16 // group_padded),
                               interpret=True)
    check_prefill(seed, rng, prefixes, chunks, kernel, num_padding=3, num_q_heads=hq,
                  num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                  soft_cap=cap, what="prefill")


def test_prefill_through_dispatch(seed):
    """Default tiling through impl="pallas_interpret"; random chunk and prefix lengths."""
    rng = np.random.default_rng(seed)
    bs = 16
    prefixes = rng.integers(0, 4 * bs, size=4)
    chunks = rng.integers(1, 24, size=4)
    check_prefill(seed, rng, prefixes, chunks,
                  functools.partial(paged_attention, decode=False, impl="pallas_interpret"),
                  reference=functools.partial(paged_attention, decode=False, impl="reference"),
                  num_padding=5, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs,
                  dtype=jnp.bfloat16, scale=0.125, soft_cap=8.0, what="prefill dispatch")


# ----------------------------------------------------------------------------- sliding window

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window, num_splits)
WINDOW_DECODE_CASES = [
    (4, 2, 64, 8, jnp.float32, None, 5, 1),      # GQA, a window not a multiple of the page
    (8, 1, 80, 16, jnp.bfloat16, 30.0, 16, 3),   # MQA, soft cap, a one-page window, split-K
    (7, 1, 96, 8, jnp.float32, 10.0, 21, 2),     # MQA group 7, soft cap, split-K
    (2, 2, 64, 8, jnp.float32, 5.0, 0, 2),       # window 0: none (every page read)
]


@pytest.mark.parametrize("traced", [False, True], ids=["int", "traced"])
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window,splits", WINDOW_DECODE_CASES)
def test_decode_sliding_window(seed, hq, hkv, d, bs, dtype, cap, window, splits, traced):
    """Garbage in the table entries before each window is never read; the window as a Python int or traced
    inside a layer scan."""
    rng = np.random.default_rng(seed)
    # context 0, within the window, just past it, many pages past it, random.
    ctx = [0, 3, window + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))]
    kernel = functools.partial(paged_decode_attention, num_splits=splits, interpret=True)
    check_window_decode(seed, rng, ctx, window, under_layer_scan(kernel) if traced else kernel, num_q_heads=hq,
                        num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5, soft_cap=cap,
                        what=f"decode splits={splits}")


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap)
WINDOW_PREFILL_DIMS = [
    (4, 2, 64, 8, jnp.float32, None),      # GQA
    (4, 1, 96, 16, jnp.bfloat16, 20.0),    # MQA, soft cap
]


@pytest.mark.parametrize("window,prefixes,chunks", WINDOW_PREFILLS)
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", WINDOW_PREFILL_DIMS)
def test_prefill_sliding_window(seed, hq, hkv, d, bs, dtype, cap, window, prefixes, chunks):
    """Chunks crossing the window, past it, inside it; 16-row tiles, so a chunk's tiles start at different pages;
    the window traced inside a layer scan."""
    rng = np.random.default_rng(seed)
    group_padded = 1 << (hq // hkv - 1).bit_length()
    kernel = functools.partial(paged_prefill_attention, block_q=max(1, 16 // group_padded), interpret=True)
    check_window_prefill(seed, rng, prefixes, chunks, window, under_layer_scan(kernel), num_padding=3,
                         num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                         scale=d ** -0.5, soft_cap=cap, what="prefill")


@pytest.mark.parametrize("window", [0, 7])
def test_sliding_window_through_dispatch(seed, window):
    """impl="pallas_interpret" passes the window on: default tiling, random lengths; window 0 means none."""
    check_window_through_dispatch(seed, window, "pallas_interpret", jnp.bfloat16, num_seqs=4)


# ----------------------------------------------------------------------------- attention sinks


def _dense_sink_attention(q, k_pages, v_pages, tables, lens, qsl, *, scale, soft_cap, window, sinks):
    """transformers' eager gpt-oss attention, row by row in float64 numpy: the visible keys' logits (scaled, soft-
    capped), the sink appended, the max subtracted, softmax, the sink's column dropped, times V. Rows of no
    sequence are zeros."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    tables, lens, qsl, sinks = (np.asarray(x) for x in (tables, lens, qsl, sinks))
    block_size, group = k_pages.shape[1], q.shape[1] // k_pages.shape[2]
    out = np.zeros_like(q)
    for s, ctx in enumerate(lens):
        positions = np.arange(ctx)
        pages = tables[s, positions // block_size]
        keys, values = k_pages[pages, positions % block_size], v_pages[pages, positions % block_size]
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            q_pos = ctx - q_len + i
            seen = (positions <= q_pos) & ((window == 0) | (positions > q_pos - window))
            for h in range(q.shape[1]):
                logits = keys[seen, h // group] @ q[qsl[s] + i, h] * scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                combined = np.append(logits, sinks[h])
                probs = np.exp(combined - combined.max())
                probs /= probs.sum()
                out[qsl[s] + i, h] = probs[:-1] @ values[seen, h // group]
    return out


@pytest.mark.parametrize("window,cap", [(0, None), (5, 5.0), (7, None)])
def test_reference_sinks_match_dense_formula(seed, window, cap):
    """The oracle itself: the reference with sinks (decode and prefill) against _dense_sink_attention."""
    rng = np.random.default_rng(seed)
    hq, hkv, d, bs = 6, 2, 16, 4
    sinks = random_sinks(rng, hq)
    prefixes, chunks = zip(*prefill_batch(bs))
    q, k, v, tables, lens, qsl = prefill_inputs(rng, prefixes, chunks, num_padding=2, num_q_heads=hq,
                                                num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=jnp.float32)
    want = _dense_sink_attention(q, k, v, tables, lens, qsl, scale=d ** -0.5, soft_cap=cap, window=window,
                                 sinks=sinks)
    got = paged_prefill_attention_ref(q, k, v, tables, lens, qsl, scale=d ** -0.5, soft_cap=cap,
                                      sliding_window=window or None, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6, err_msg=f"prefill seed={seed}")
    q, k, v, tables, lens = decode_inputs(rng, [0, 1, bs, 3 * bs + 1, 9], num_q_heads=hq, num_kv_heads=hkv,
                                          head_dim=d, block_size=bs, dtype=jnp.float32)
    want = _dense_sink_attention(q, k, v, tables, lens, np.arange(len(lens) + 1), scale=d ** -0.5, soft_cap=cap,
                                 window=window, sinks=sinks)
    got = paged_decode_attention_ref(q, k, v, tables, lens, scale=d ** -0.5, soft_cap=cap,
                                     sliding_window=window or None, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6, err_msg=f"decode seed={seed}")
    # The sinks change the result: a reference that dropped them would not pass the checks above.
    plain = paged_decode_attention_ref(q, k, v, tables, lens, scale=d ** -0.5, soft_cap=cap,
                                       sliding_window=window or None)
    assert not np.allclose(np.asarray(plain), want, atol=1e-3), f"seed={seed}"


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window, num_splits)
SINK_DECODE_CASES = [
    (4, 2, 64, 8, jnp.float32, None, 0, 1),      # GQA, no window, one split
    (8, 1, 80, 16, jnp.bfloat16, 30.0, 16, 1),   # MQA, soft cap, window
    (8, 2, 128, 32, jnp.float32, 5.0, 0, 3),     # split-K: the sinks join in the epilogue
    (7, 1, 96, 8, jnp.float32, 10.0, 21, 2),     # group 7, soft cap, window, split-K
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window,splits", SINK_DECODE_CASES)
def test_decode_sinks(seed, hq, hkv, d, bs, dtype, cap, window, splits):
    """Random sinks (+10, +5, -4 and random ones), with and without a window and a soft cap, one split and
    split-K; context-0 rows stay zeros."""
    rng = np.random.default_rng(seed)
    ctx = [0, 1, 3, window + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))]
    kernel = functools.partial(paged_decode_attention, num_splits=splits, interpret=True)
    check_window_decode(seed, rng, ctx, window, kernel, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                        block_size=bs, dtype=dtype, scale=d ** -0.5, soft_cap=cap, sinks=random_sinks(rng, hq),
                        what=f"decode sinks splits={splits}")


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window)
SINK_PREFILL_CASES = [
    (4, 2, 64, 8, jnp.float32, None, 0),      # GQA
    (4, 1, 96, 16, jnp.bfloat16, 20.0, 5),    # MQA, soft cap, window
    (6, 2, 64, 8, jnp.float32, 5.0, 16),      # group 3 (padded to 4), soft cap, window
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window", SINK_PREFILL_CASES)
def test_prefill_sinks(seed, hq, hkv, d, bs, dtype, cap, window):
    """Random sinks over the shared prefill batch (16-row tiles), with and without a window and a soft cap."""
    rng = np.random.default_rng(seed)
    prefixes, chunks = zip(*prefill_batch(bs))
    group_padded = 1 << (hq // hkv - 1).bit_length()
    kernel = functools.partial(paged_prefill_attention, block_q=max(1, 16 // group_padded), interpret=True)
    check_window_prefill(seed, rng, prefixes, chunks, window, kernel, num_padding=3, num_q_heads=hq,
                         num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5, soft_cap=cap,
                         sinks=random_sinks(rng, hq), what="prefill sinks")


def test_sinks_through_dispatch(seed):
    """impl="pallas_interpret" passes the sinks on, prefill and decode, at its default tiling, under a window."""
    check_window_through_dispatch(seed, 7, "pallas_interpret", jnp.bfloat16, num_seqs=4, with_sinks=True)


# ----------------------------------------------------------------------------- the poison works


def _drop_last_feature(store):
    """A masked_store that 'forgets' the last feature (column head_dim - 1) of every row."""
    def broken(ref, idx, val, mask):
        cols = jnp.arange(mask.shape[-1])
        store(ref, idx, val, mask & (cols != ref.shape[-1] - 1))
    return broken


def test_unwritten_output_is_caught(seed, monkeypatch):
    """The NaN-poisoned outputs really expose a kernel that skips elements."""
    rng = np.random.default_rng(seed)
    q, k, v, tables, lens = decode_inputs(rng, [9, 3], num_q_heads=2, num_kv_heads=1, head_dim=48,
                                          block_size=8, dtype=jnp.float32)
    qsl = jnp.asarray([0, 1, 2], jnp.int32)
    monkeypatch.setattr(decode_mod, "masked_store", _drop_last_feature(decode_mod.masked_store))
    monkeypatch.setattr(prefill_mod, "masked_store", _drop_last_feature(prefill_mod.masked_store))
    # head_dim 48 is used nowhere else, so these traces are fresh and see the broken store.
    out = np.asarray(paged_decode_attention(q, k, v, tables, lens, scale=0.1, interpret=True))
    assert np.isnan(out[..., -1]).all() and np.isfinite(out[..., :-1]).all()
    out = np.asarray(paged_prefill_attention(q, k, v, tables, lens, qsl, scale=0.1,
                                             interpret=True))
    assert np.isnan(out[..., -1]).all() and np.isfinite(out[..., :-1]).all()


def test_garbage_outside_contexts_changes_nothing(seed):
    """Outputs are bit-identical whether unowned slots hold NaN/inf or zeros, and whatever the
    unused block-table entries say."""
    rng = np.random.default_rng(seed)
    bs, ctx, q_lens = 8, [13, 8, 1], [5, 1, 1]
    k, v, tables = make_cache(rng, ctx, block_size=bs, num_kv_heads=2, head_dim=64,
                              dtype=jnp.float32)
    owned = np.isfinite(np.asarray(k))
    clean_k, clean_v = jnp.where(owned, k, 0.0), jnp.where(owned, v, 0.0)
    dirty_k, dirty_v = jnp.where(owned, k, jnp.inf), jnp.where(owned, v, -jnp.inf)
    other_tables = np.asarray(tables).copy()
    for s, c in enumerate(ctx):
        other_tables[s, -(-c // bs):] = rng.integers(-5, 10**6, other_tables.shape[1] - (-(-c // bs)))
    lens = jnp.asarray(ctx, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q_dec = random_q(rng, len(ctx), 4, 64, jnp.float32)
    q_pre = random_q(rng, sum(q_lens) + 2, 4, 64, jnp.float32)
    results = []
    for kk, vv, tt in ((clean_k, clean_v, tables), (k, v, tables),
                       (dirty_k, dirty_v, jnp.asarray(other_tables))):
        results.append((
            np.asarray(paged_decode_attention(q_dec, kk, vv, tt, lens, scale=0.125, num_splits=2,
                                              interpret=True)),
            np.asarray(paged_prefill_attention(q_pre, kk, vv, tt, lens, qsl, scale=0.125,
                                               interpret=True))))
    for decode_out, prefill_out in results:
        assert np.isfinite(decode_out).all() and np.isfinite(prefill_out).all(), f"seed={seed}"
        np.testing.assert_array_equal(decode_out, results[0][0], err_msg=f"seed={seed}")
        np.testing.assert_array_equal(prefill_out, results[0][1], err_msg=f"seed={seed}")
