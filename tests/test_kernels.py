"""Pallas paged-attention kernels (interpret mode, CPU) against the plain-jnp references.

Every test draws a fresh seed (printed, and in every assertion message; set FERRY_KERNEL_SEED to
replay one). Inputs are built to catch the usual paged-attention bugs:
  * block tables are shuffled, non-contiguous page ids (never the null block 0);
  * every cache slot no sequence owns is NaN: whole unused pages, the slots past context_len in
    a sequence's last page, and the pages unused block-table entries point to (other unused
    entries hold out-of-range ids) -- so reading anything beyond context_len shows up as NaN;
  * in interpret mode the kernels start from NaN-filled output buffers (aliased into the
    pallas_call), so an output element a kernel never writes fails the finiteness check, and
    rows that attend to nothing (context 0, prefill padding) must come out exactly zero.
"""

import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as decode_mod
from pallas_kernels import prefill_attention as prefill_mod
from pallas_kernels.attention import paged_attention
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention
from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@pytest.fixture
def seed():
    value = int(os.environ.get("FERRY_KERNEL_SEED", secrets.randbits(31)))
    print(f"FERRY_KERNEL_SEED={value}")  # shown by pytest when the test fails
    return value


def make_cache(rng, context_lens, *, block_size, num_kv_heads, head_dim, dtype, table_width=None,
               spare_blocks=3):
    """Random paged cache for sequences of the given context lengths.

    Returns (k_pages, v_pages, block_tables). Slots that belong to no sequence are NaN.
    """
    pages = [-(-c // block_size) for c in context_lens]
    width = table_width or max(max(pages) + 2, 1)
    num_blocks = 1 + sum(pages) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    ids = rng.permutation(np.arange(1, num_blocks))  # shuffled, never the null block
    used, spare = ids[:sum(pages)], ids[sum(pages):]
    tables = np.zeros((len(context_lens), width), np.int32)
    start = 0
    for s, (ctx, n) in enumerate(zip(context_lens, pages)):
        own = used[start:start + n]
        start += n
        tables[s, :n] = own
        for j, block in enumerate(own):
            valid = min(block_size, ctx - j * block_size)  # the rest of the last page stays NaN
            k[block, :valid] = rng.standard_normal((valid, num_kv_heads, head_dim))
            v[block, :valid] = rng.standard_normal((valid, num_kv_heads, head_dim))
        # Unused entries: NaN pages, the null block, or ids far out of range.
        garbage = rng.choice(np.concatenate([spare, [0, num_blocks + 1000, 2**30]]), width - n)
        tables[s, n:] = garbage
    return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables))


def random_q(rng, num_rows, num_q_heads, head_dim, dtype, magnitude=2.0):
    # magnitude > 1 makes scores large enough for the soft cap to bite.
    return jnp.asarray(magnitude * rng.standard_normal((num_rows, num_q_heads, head_dim)), dtype)


def check_close(out, ref, dtype, seed, what):
    assert out.dtype == ref.dtype == jnp.dtype(dtype), f"{what}: dtype {out.dtype} seed={seed}"
    assert out.shape == ref.shape, f"{what}: shape {out.shape} vs {ref.shape} seed={seed}"
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(ref).all(), f"{what}: reference not finite seed={seed}"
    bad = ~np.isfinite(out)
    assert not bad.any(), (f"{what}: {bad.sum()} non-finite outputs (unwritten or leaked), first at "
                           f"{np.argwhere(bad)[0].tolist()} seed={seed}")
    tol = TOL[dtype]
    scale = max(float(np.abs(ref).max()), 1e-6)
    err = np.abs(out - ref)
    worst = np.unravel_index(err.argmax(), err.shape)
    assert np.allclose(out, ref, rtol=tol, atol=tol * scale), (
        f"{what}: max abs err {err.max():.3g} at {list(worst)} (ref max {scale:.3g}, tol {tol}) "
        f"seed={seed}")


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
    k, v, tables = make_cache(rng, ctx, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    q = random_q(rng, len(ctx), hq, d, dtype)
    lens = jnp.asarray(ctx, jnp.int32)
    scale = d ** -0.5
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale, soft_cap=cap)
    out = paged_decode_attention(q, k, v, tables, lens, scale=scale, soft_cap=cap,
                                 num_splits=splits, interpret=True)
    check_close(out, ref, dtype, seed, f"decode splits={splits}")
    assert (np.asarray(out[0], np.float32) == 0).all(), f"context-0 row not zero seed={seed}"


def test_decode_through_dispatch(seed):
    """impl="pallas_interpret" reaches the kernel; split-K with more splits than pages."""
    rng = np.random.default_rng(seed)
    ctx = [3 * 8 + 5, 0, 8, 1]
    k, v, tables = make_cache(rng, ctx, block_size=8, num_kv_heads=2, head_dim=64,
                              dtype=jnp.float32)
    q = random_q(rng, len(ctx), 8, 64, jnp.float32)
    lens = jnp.asarray(ctx, jnp.int32)
    ref = paged_attention(q, k, v, tables, lens, None, decode=True, scale=0.125, impl="reference")
    out = paged_attention(q, k, v, tables, lens, None, decode=True, scale=0.125,
                          impl="pallas_interpret")
    check_close(out, ref, jnp.float32, seed, "decode dispatch")
    # 8 splits over at most 4 pages: most splits are empty and must contribute nothing.
    out = paged_decode_attention(q, k, v, tables, lens, scale=0.125, num_splits=8,
                                 pages_per_step=2, interpret=True)
    check_close(out, ref, jnp.float32, seed, "decode 8 splits")


# ----------------------------------------------------------------------------- prefill

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap)
PREFILL_CASES = [
    (2, 2, 64, 8, jnp.float32, None),      # MHA
    (4, 2, 96, 16, jnp.bfloat16, 20.0),    # group 2, head_dim 96
    (4, 1, 80, 8, jnp.float32, 5.0),       # MQA group 4, head_dim 80
    (8, 1, 256, 16, jnp.bfloat16, None),   # MQA group 8, head_dim 256
    (14, 2, 128, 32, jnp.float32, None),   # group 7 (Qwen2.5-style)
]


def prefill_batch(bs):
    """(prefix tokens already cached, chunk length) per sequence."""
    return [
        (0, 11),            # fresh prompt, several query tiles
        (3 * bs, 1),        # 1-token chunk after whole pages
        (9 * bs + 3, 4),    # prefix-cache hit: chunk starts after many cached pages
        (bs - 1, bs + 2),   # chunk crosses page boundaries
        (5, 0),             # sequence with no query rows this step
        (0, 1),             # single-token prompt
    ]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", PREFILL_CASES)
def test_prefill_matches_reference(seed, hq, hkv, d, bs, dtype, cap):
    rng = np.random.default_rng(seed)
    batch = prefill_batch(bs)
    ctx = [p + c for p, c in batch]
    q_lens = [c for _, c in batch]
    num_padding = 3
    num_tokens = sum(q_lens) + num_padding
    k, v, tables = make_cache(rng, ctx, block_size=bs, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    q = random_q(rng, num_tokens, hq, d, dtype)
    lens = jnp.asarray(ctx, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    scale = d ** -0.5
    ref = paged_prefill_attention_ref(q, k, v, tables, lens, qsl, scale=scale, soft_cap=cap)
    # Small query tiles (16 rows) so long chunks span several tiles.
    group_padded = 1 << (hq // hkv - 1).bit_length()
    out = paged_prefill_attention(q, k, v, tables, lens, qsl, scale=scale, soft_cap=cap,
                                  block_q=max(1, 16 // group_padded), interpret=True)
    check_close(out, ref, dtype, seed, "prefill")
    assert (np.asarray(out[-num_padding:], np.float32) == 0).all(), \
        f"padding rows not zero seed={seed}"


def test_prefill_through_dispatch(seed):
    """Default tiling through impl="pallas_interpret"; random chunk and prefix lengths."""
    rng = np.random.default_rng(seed)
    bs = 16
    prefixes = rng.integers(0, 4 * bs, size=4)
    chunks = rng.integers(1, 24, size=4)
    ctx = [int(p + c) for p, c in zip(prefixes, chunks)]
    k, v, tables = make_cache(rng, ctx, block_size=bs, num_kv_heads=2, head_dim=64,
                              dtype=jnp.bfloat16)
    num_tokens = int(chunks.sum()) + 5
    q = random_q(rng, num_tokens, 8, 64, jnp.bfloat16)
    lens = jnp.asarray(ctx, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    ref = paged_attention(q, k, v, tables, lens, qsl, decode=False, scale=0.125,
                          soft_cap=8.0, impl="reference")
    out = paged_attention(q, k, v, tables, lens, qsl, decode=False, scale=0.125,
                          soft_cap=8.0, impl="pallas_interpret")
    check_close(out, ref, jnp.bfloat16, seed, "prefill dispatch")
    assert (np.asarray(out[-5:], np.float32) == 0).all(), f"padding rows not zero seed={seed}"


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
    ctx = [9, 3]
    k, v, tables = make_cache(rng, ctx, block_size=8, num_kv_heads=1, head_dim=48,
                              dtype=jnp.float32)
    q = random_q(rng, len(ctx), 2, 48, jnp.float32)
    lens = jnp.asarray(ctx, jnp.int32)
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
