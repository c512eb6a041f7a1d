"""Inputs and checks shared by the paged-attention kernel tests (test_kernels.py, test_native_kernel.py).

Every test draws a fresh seed (the `seed` fixture, tests/pallas_kernels/conftest.py: printed, and in every assertion
message; set FERRY_KERNEL_SEED to replay one). Inputs are built to catch the usual paged-attention bugs:
  * block tables are shuffled, non-contiguous page ids (never the null block 0);
  * every cache slot no sequence owns is NaN: whole unused pages, the slots past context_len in a
    sequence's last page, and the pages unused block-table entries point to (other unused entries
    hold out-of-range ids) -- so reading anything beyond context_len shows up as NaN.
"""


import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap)
PREFILL_CASES = [
    (2, 2, 64, 8, jnp.float32, None),      # MHA
    (4, 2, 96, 16, jnp.bfloat16, 20.0),    # group 2, head_dim 96
    (4, 1, 80, 8, jnp.float32, 5.0),       # MQA group 4, head_dim 80
    (8, 1, 256, 16, jnp.bfloat16, None),   # MQA group 8, head_dim 256
    (14, 2, 128, 32, jnp.float32, None),   # group 7 (Qwen2.5-style)
]


def make_cache(rng, context_lens, *, block_size, num_kv_heads, head_dim, dtype, spare_blocks=3):
    """Random paged cache for sequences of the given context lengths.

    Returns (k_pages, v_pages, block_tables). Slots that belong to no sequence are NaN.
    """
    pages = [-(-c // block_size) for c in context_lens]
    width = max(max(pages) + 2, 1)
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
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables)


def random_q(rng, num_rows, num_q_heads, head_dim, dtype, magnitude=2.0):
    # magnitude > 1 makes scores large enough for the soft cap to bite.
    return jnp.asarray(magnitude * rng.standard_normal((num_rows, num_q_heads, head_dim)), dtype)


def decode_inputs(rng, context_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    """(q, k_pages, v_pages, block_tables, context_lens) for one decode step: a query row a sequence."""
    k, v, tables = make_cache(rng, context_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=dtype)
    q = random_q(rng, len(context_lens), num_q_heads, head_dim, dtype)
    return q, k, v, tables, jnp.asarray(context_lens, jnp.int32)


def prefill_inputs(rng, prefixes, chunks, *, num_padding, num_q_heads, num_kv_heads, head_dim,
                   block_size, dtype):
    """(q, k_pages, v_pages, block_tables, context_lens, query_start_loc) for one prefill step.

    Sequence i has prefixes[i] tokens already cached and a chunk of chunks[i] query rows; num_padding
    rows that belong to no sequence follow the last chunk.
    """
    ctx = [int(p + c) for p, c in zip(prefixes, chunks)]
    k, v, tables = make_cache(rng, ctx, block_size=block_size, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=dtype)
    q = random_q(rng, int(sum(chunks)) + num_padding, num_q_heads, head_dim, dtype)
    lens = jnp.asarray(ctx, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    return q, k, v, tables, lens, qsl


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


def random_sinks(rng, num_q_heads):
    """Attention sinks, float32 [num_q_heads]: +10 (above every score: it takes most of each row's softmax), +5
    (around the largest scores), -4, then random ones (normal, sd 2), in a shuffled head order."""
    fixed = np.array([10.0, 5.0, -4.0])[:num_q_heads]
    sinks = np.concatenate([fixed, 2.0 * rng.standard_normal(num_q_heads - len(fixed))])
    return jnp.asarray(rng.permutation(sinks), jnp.float32)


def _with_sinks(sinks):
    """The sinks keyword where a test passes sinks: kernels under test are called as before without them."""
    return {} if sinks is None else {"sinks": sinks}


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


def assert_zero_rows(out, rows, what, seed):
    """Rows that attend to nothing (context 0, prefill padding) must come out exactly zero."""
    assert (np.asarray(out[rows], np.float32) == 0).all(), f"{what} not zero seed={seed}"


def check_prefill(seed, rng, prefixes, chunks, kernel, *, reference=paged_prefill_attention_ref,
                  num_padding, num_q_heads, num_kv_heads, head_dim, block_size, dtype, scale,
                  soft_cap, what, sinks=None):
    """kernel(q, k, v, tables, lens, qsl, scale=, soft_cap=[, sinks=]) on prefill_inputs(...) matches
    `reference` called the same way, and the num_padding rows at the end come out zero."""
    q, k, v, tables, lens, qsl = prefill_inputs(
        rng, prefixes, chunks, num_padding=num_padding, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    ref = reference(q, k, v, tables, lens, qsl, scale=scale, soft_cap=soft_cap, **_with_sinks(sinks))
    out = kernel(q, k, v, tables, lens, qsl, scale=scale, soft_cap=soft_cap, **_with_sinks(sinks))
    check_close(out, ref, dtype, seed, what)
    assert_zero_rows(out, slice(-num_padding, None), "padding rows", seed)


def run_poisoned(fn, q, *args, **kwargs):
    """fn(q, *args, **kwargs) jitted, its output written into a donated NaN-filled buffer.

    Any element the kernel does not write stays NaN. The buffer really is the output (checked by
    address), otherwise the poison would prove nothing.
    """
    def call(poison, *a):
        del poison  # donated and kept: XLA places the result in its buffer
        return fn(*a, **kwargs)

    poison = jnp.full(q.shape, jnp.nan, q.dtype)
    address = poison.unsafe_buffer_pointer()
    out = jax.jit(call, donate_argnums=0, keep_unused=True)(poison, q, *args)
    assert out.unsafe_buffer_pointer() == address, "output did not land in the poisoned buffer"
    return out


def drop_blocks_before_window(rng, tables, context_lens, query_lens, window: int, block_size: int):
    """Block tables as the KV cache manager leaves them under a sliding window: the entries of blocks wholly
    before every query's window (its first query at context_len - query_len sees keys > that - window) hold
    garbage: the null block or ids far out of range. A kernel that reads them reads NaN or faults."""
    tables = np.array(tables)
    for s, (ctx, q_len) in enumerate(zip(np.asarray(context_lens), np.asarray(query_lens))):
        first_kept = max(int(ctx) - int(q_len) - window + 1, 0) // block_size
        tables[s, :first_kept] = rng.choice(np.array([0, 2**30, tables.shape[1] + 10**6], np.int64),
                                            first_kept).astype(np.int32)
    return jnp.asarray(tables)


# (window, prefixes, chunks): sliding-window prefill cases, chunks that cross the window, start past it, or sit
# in it entirely; the window not a multiple of the block size.
WINDOW_PREFILLS = [
    (5, (0, 30, 17, 3), (13, 4, 1, 2)),
    (16, (40, 0, 9), (25, 7, 30)),
]


def under_layer_scan(kernel):
    """`kernel` called as the model calls it: under jax.jit, its sliding window a traced int32 scalar picked inside a
    jax.lax.scan over layers (one layer here), never a static value."""
    def call(*args, sliding_window, **kwargs):
        def layers(windows, *a):
            return jax.lax.scan(lambda c, w: (c, kernel(*a, sliding_window=w, **kwargs)), 0, windows)[1]
        return jax.jit(layers)(jnp.asarray([sliding_window], jnp.int32), *args)[0]
    return call


def check_window_decode(seed, rng, context_lens, window, kernel, *, num_q_heads, num_kv_heads, head_dim, block_size,
                        dtype, scale, soft_cap, what, sinks=None):
    """kernel(q, k, v, tables, lens, scale=, soft_cap=, sliding_window=window[, sinks=]) on decode_inputs(...)
    matches the reference over the intact tables (window 0: the reference without a window), where the kernel's
    tables hold garbage before each query's window (window > 0); context-0 rows come out zero."""
    q, k, v, tables, lens = decode_inputs(rng, context_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                          head_dim=head_dim, block_size=block_size, dtype=dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale, soft_cap=soft_cap,
                                     sliding_window=window or None, **_with_sinks(sinks))
    if window > 0:
        tables = drop_blocks_before_window(rng, tables, lens, np.ones(len(context_lens), np.int32), window,
                                           block_size)
    out = kernel(q, k, v, tables, lens, scale=scale, soft_cap=soft_cap, sliding_window=window, **_with_sinks(sinks))
    check_close(out, ref, dtype, seed, f"{what} window={window}")
    assert_zero_rows(out, np.asarray(context_lens) == 0, "context-0 rows", seed)


def check_window_prefill(seed, rng, prefixes, chunks, window, kernel, *, num_padding, num_q_heads, num_kv_heads,
                         head_dim, block_size, dtype, scale, soft_cap, what, sinks=None):
    """check_prefill under a sliding window: kernel(..., sliding_window=window[, sinks=]) over tables holding
    garbage before each sequence's window (window > 0) matches the reference over the intact tables (window 0:
    without a window); the padding rows come out zero."""
    q, k, v, tables, lens, qsl = prefill_inputs(
        rng, prefixes, chunks, num_padding=num_padding, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype)
    ref = paged_prefill_attention_ref(q, k, v, tables, lens, qsl, scale=scale, soft_cap=soft_cap,
                                      sliding_window=window or None, **_with_sinks(sinks))
    if window > 0:
        tables = drop_blocks_before_window(rng, tables, lens, chunks, window, block_size)
    out = kernel(q, k, v, tables, lens, qsl, scale=scale, soft_cap=soft_cap, sliding_window=window,
                 **_with_sinks(sinks))
    check_close(out, ref, dtype, seed, f"{what} window={window}")
    assert_zero_rows(out, slice(-num_padding, None), "padding rows", seed)


def check_window_through_dispatch(seed, window, impl: str, dtype, num_seqs: int, with_sinks: bool = False):
    """pallas_kernels.attention.paged_attention(impl=...) passes the window (and, with_sinks, random sinks) on,
    prefill and decode, at the impl's default tiling: random prefill lengths, decode contexts from 0 to 100;
    window 0 means none."""
    from pallas_kernels.attention import paged_attention  # noqa: PLC0415 (imports the kernels' dispatch)

    rng = np.random.default_rng(seed)
    prefixes, chunks = rng.integers(0, 64, size=num_seqs), rng.integers(1, 24, size=num_seqs)
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, scale=0.125,
                 sinks=random_sinks(rng, 8) if with_sinks else None)
    check_window_prefill(seed, rng, prefixes, chunks, window,
                         functools.partial(paged_attention, decode=False, impl=impl), num_padding=5, soft_cap=8.0,
                         what=f"{impl} prefill dispatch", **shape)
    check_window_decode(seed, rng, [0, 5, 40, 100], window,
                        lambda *a, **kw: paged_attention(*a, None, decode=True, impl=impl, **kw), soft_cap=None,
                        what=f"{impl} decode dispatch", **shape)
