"""Native CPU paged attention (XLA FFI, pallas_kernels/native/) against the plain-jnp references.

The library must be there: it is built when the package is installed (setup.py), so every test
here FAILS, never skips, when `library.available()` is False (the `native_library` fixture).

Inputs, seeds and checks are tests/helpers/attention_cases.py's, as in tests/pallas_kernels/test_kernels.py: shuffled
block
tables, NaN in every cache slot no sequence owns. The kernel's output lands in a donated NaN-filled
buffer (checked by pointer) here, so an element it never writes fails the finiteness check, and the
rows that attend to nothing (context 0, prefill padding) must be exactly zero.
"""

import functools
import os

import jax
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
    decode_inputs,
    prefill_batch,
    prefill_inputs,
    random_sinks,
    run_poisoned,
    under_layer_scan,
)
from pallas_kernels.native import library
from pallas_kernels.native import ops as native
from pallas_kernels.native.ops import paged_decode_attention_native, paged_prefill_attention_native
from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

pytestmark = pytest.mark.usefixtures("native_library")
POISONED_PREFILL = functools.partial(run_poisoned, paged_prefill_attention_native)


# ----------------------------------------------------------------------------- decode

@pytest.fixture(params=["default_tiles", "avx2_tiles", "vector_tiles"])
def attention_tiles(request, monkeypatch):
    """Each attention path: the CPU's own (on AVX-512 the GEMM prefill tiles, head_dim a multiple of 16:
    every one here but 52 and 80, and the decode tiles, a multiple of 32; on AVX2 the prefill and decode
    tiles, a multiple of 8: all but 52), AVX2's tiles on an AVX-512 CPU too, and the vector-at-a-time tiles
    every other case runs."""
    if request.param == "avx2_tiles":
        monkeypatch.setenv("FERRY_NATIVE_NO_AVX512", "1")
    if request.param == "vector_tiles":
        monkeypatch.setenv("FERRY_NATIVE_ATTENTION_NO_GEMM_TILES", "1")
    return request.param


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap)
DECODE_CASES = [
    (2, 2, 64, 8, jnp.float32, None),       # MHA, group 1
    (4, 2, 80, 16, jnp.bfloat16, 30.0),     # group 2, head_dim 80
    (8, 2, 128, 32, jnp.float32, 5.0),      # group 4, soft cap
    (8, 1, 256, 16, jnp.bfloat16, None),    # MQA, group 8, head_dim 256
    (16, 2, 96, 128, jnp.float32, 10.0),    # group 8, head_dim 96, block_size 128
    (7, 1, 52, 8, jnp.float32, 10.0),       # group 7 (not a power of two), head_dim 52 (tail)
    (8, 4, 32, 16, jnp.float32, None),      # the benchmark's shape, head_dim 32
    (8, 4, 32, 16, jnp.bfloat16, 20.0),     # the same in bfloat16, soft cap
    (16, 16, 64, 16, jnp.bfloat16, 50.0),   # many heads, group 1, bfloat16, soft cap
    (6, 2, 64, 16, jnp.bfloat16, None),     # group 3: the AVX-512 tile's last query vector paired with itself
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", DECODE_CASES)
def test_decode_matches_reference(seed, hq, hkv, d, bs, dtype, cap, attention_tiles):
    rng = np.random.default_rng(seed)
    # context 0 (padding row), 1, one full page, one page + 1, several pages, random, long.
    ctx = [0, 1, bs, bs + 1, 5 * bs + 3, int(rng.integers(1, 4 * bs)), 2048 + int(rng.integers(bs))]
    q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=bs, dtype=dtype)
    scale = d ** -0.5
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale, soft_cap=cap)
    out = run_poisoned(paged_decode_attention_native, q, k, v, tables, lens, scale=scale,
                       soft_cap=cap)
    check_close(out, ref, dtype, seed, "decode")
    assert_zero_rows(out, 0, "context-0 row", seed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_large_batch(seed, dtype, monkeypatch, attention_tiles):
    """A batch big enough that one work item takes all kv heads of a sequence (the decode fast
    path), long contexts (page prefetch), and the same bits on one thread as on the pool."""
    rng = np.random.default_rng(seed)
    bs, hkv, hq, d = 16, 4, 8, 64
    ctx = [int(c) for c in rng.integers(0, 40 * bs, size=40)] + [0, 1, bs, 64 * bs + 1]
    q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=bs, dtype=dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=0.125)
    out = run_poisoned(paged_decode_attention_native, q, k, v, tables, lens, scale=0.125)
    check_close(out, ref, dtype, seed, "decode large batch")
    # One thread, and more than the pool has (the extra ones start late, the others taking their items)
    for threads in ("1", "5"):
        monkeypatch.setenv("FERRY_NATIVE_ATTENTION_THREADS", threads)
        again = run_poisoned(paged_decode_attention_native, q, k, v, tables, lens, scale=0.125)
        np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32),
                                      err_msg=f"{threads} thread(s) changed the result seed={seed}")


def test_decode_small_batch_splits_heads(seed, attention_tiles):
    """One or two sequences: heads are split across work items."""
    rng = np.random.default_rng(seed)
    for ctx in ([300], [1, 77]):
        q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=16, num_kv_heads=8, head_dim=64,
                                              block_size=8, dtype=jnp.float32)
        ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=0.125, soft_cap=20.0)
        out = run_poisoned(paged_decode_attention_native, q, k, v, tables, lens, scale=0.125,
                           soft_cap=20.0)
        check_close(out, ref, jnp.float32, seed, f"decode batch {len(ctx)}")


def test_float32_queries_over_bfloat16_pages(seed, attention_tiles):
    """A bf16 KV cache under a float32 model: float32 q and output over bf16 pages, decode and prefill,
    against the reference on the same pages (float32 accumulation, so float32 tolerance)."""
    rng = np.random.default_rng(seed)
    bf16 = lambda x: x.astype(jnp.bfloat16)  # noqa: E731 (NaN in unowned slots stays NaN)
    q, k, v, tables, lens = decode_inputs(rng, [0, 1, 17, 300], num_q_heads=8, num_kv_heads=2, head_dim=64,
                                          block_size=16, dtype=jnp.float32)
    ref = paged_decode_attention_ref(q, bf16(k), bf16(v), tables, lens, scale=0.125, soft_cap=30.0)
    out = run_poisoned(paged_decode_attention_native, q, bf16(k), bf16(v), tables, lens, scale=0.125,
                       soft_cap=30.0)
    check_close(out, ref, jnp.float32, seed, "decode f32 q, bf16 pages")
    assert_zero_rows(out, 0, "context-0 row", seed)
    bf16_pages = lambda fn: lambda q, k, v, *a, **kw: fn(q, bf16(k), bf16(v), *a, **kw)  # noqa: E731
    prefixes, chunks = zip(*native_prefill_batch(16))
    check_prefill(seed, rng, prefixes, chunks, bf16_pages(POISONED_PREFILL),
                  reference=bf16_pages(paged_prefill_attention_ref), num_padding=3, num_q_heads=8,
                  num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32, scale=0.125, soft_cap=None,
                  what="prefill f32 q, bf16 pages")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kv_write_matches_scatter_in_place(seed, dtype):
    """kv_write sets exactly the addressed rows (out-of-range slots dropped) like `.at[].set(mode="drop")`,
    into the donated pages' own buffer."""
    rng = np.random.default_rng(seed)
    nb, bs, h, d, t = 6, 4, 2, 8, 7
    pages = jnp.asarray(rng.standard_normal((nb, bs, h, d)), dtype)
    updates = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)  # cast to the pages' dtype
    slots = rng.choice(nb * bs, size=t, replace=False).astype(np.int32)
    slots[-1] = nb * bs + 3  # past the end: dropped
    flat = pages.reshape(nb * bs, h, d)
    want = flat.at[slots].set(updates.astype(dtype), mode="drop").reshape(pages.shape)
    address = pages.unsafe_buffer_pointer()
    got = jax.jit(native.kv_write, donate_argnums=0)(pages, updates, slots)
    assert got.unsafe_buffer_pointer() == address, "kv_write copied the pages"
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=f"seed={seed}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_swap_in_writes_blocks_in_place(seed, dtype):
    """A swap-in (engine.worker.kv_cache.scatter_blocks) through the native row write on a whole [L, NB, BS, H, D] pool:
    the blocks land where `.at[:, block_ids].set` puts them (padding ids on the null block), into the donated
    pool's own buffer, and the compiled program neither copies nor widens the pool."""
    from engine.worker.kv_cache import scatter_blocks

    rng = np.random.default_rng(seed)
    layers, nb, bs, h, d, n = 3, 9, 4, 2, 8, 4
    pools = tuple(jnp.asarray(rng.standard_normal((layers, nb, bs, h, d)), dtype) for _ in range(2))
    ids = np.zeros(n, np.int32)  # the last one padding: the null block
    ids[:n - 1] = rng.choice(np.arange(1, nb), size=n - 1, replace=False)
    blocks = tuple(jnp.asarray(rng.standard_normal((layers, n, bs, h, d)), dtype) for _ in range(2))
    want = [np.asarray(p.at[:, ids].set(b), np.float32) for p, b in zip(pools, blocks)]
    lines = scatter_blocks.lower(pools, jnp.asarray(ids), blocks, True).compile().as_text().splitlines()
    pool_shape = f"[{layers},{nb},{bs},{h},{d}]"
    assert not [line for line in lines if pool_shape in line and (" copy(" in line or "convert" in line)], (
        "the pool was copied")
    addresses = [p.unsafe_buffer_pointer() for p in pools]
    got = scatter_blocks(pools, jnp.asarray(ids), blocks, True)
    assert [p.unsafe_buffer_pointer() for p in got] == addresses, "the swap-in copied the pool"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), w, err_msg=f"seed={seed}")


# ----------------------------------------------------------------------------- prefill

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap): test_kernels.py's, and
NATIVE_PREFILL_CASES = PREFILL_CASES + [
    (8, 4, 32, 16, jnp.float32, 30.0),     # group 2, head_dim 32, soft cap
    (8, 4, 64, 16, jnp.bfloat16, None),    # group 2, head_dim 64 in bf16 (a head dim the AVX-512 tiles compile in)
]


def native_prefill_batch(bs):
    """test_kernels.py's (prefix tokens already cached, chunk length) per sequence, and one more."""
    return prefill_batch(bs) + [
        (2 * bs + 5, 45),   # chunk spanning several query tiles after a prefix
    ]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", NATIVE_PREFILL_CASES)
def test_prefill_matches_reference(seed, hq, hkv, d, bs, dtype, cap, attention_tiles):
    rng = np.random.default_rng(seed)
    prefixes, chunks = zip(*native_prefill_batch(bs))
    check_prefill(seed, rng, prefixes, chunks, POISONED_PREFILL, num_padding=3, num_q_heads=hq,
                  num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                  soft_cap=cap, what="prefill")


def test_prefill_random_chunks(seed, attention_tiles):
    """Random prefix and chunk lengths, bfloat16, soft cap, padding at the end."""
    rng = np.random.default_rng(seed)
    bs = 16
    prefixes = rng.integers(0, 6 * bs, size=5)
    chunks = rng.integers(1, 40, size=5)
    check_prefill(seed, rng, prefixes, chunks, POISONED_PREFILL, num_padding=5, num_q_heads=8,
                  num_kv_heads=2, head_dim=64, block_size=bs, dtype=jnp.bfloat16, scale=0.125,
                  soft_cap=8.0, what="prefill random chunks")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_of_one_token_chunks_is_decode(seed, dtype, attention_tiles):
    """A ragged prefill's one-token sequences (a step's decodes, here among longer chunks, in random order) take
    the decode kernel's tiles: their rows equal a decode call's on the same cache bit for bit, so a request
    samples the same token in a ragged step as in a decode step; the chunks still match the reference."""
    rng = np.random.default_rng(seed)
    bs = 8
    prefixes = [int(p) for p in rng.integers(0, 12 * bs, size=7)]
    chunks = [int(c) for c in rng.permutation([1, 1, 1, 1, 13, 20, 1])]
    q, k, v, tables, lens, qsl = prefill_inputs(rng, prefixes, chunks, num_padding=2, num_q_heads=4,
                                                num_kv_heads=2, head_dim=64, block_size=bs, dtype=dtype)
    pre = paged_prefill_attention_native(q, k, v, tables, lens, qsl, scale=0.125)
    check_close(pre, paged_prefill_attention_ref(q, k, v, tables, lens, qsl, scale=0.125), dtype, seed,
                "ragged prefill")
    one = np.flatnonzero(np.asarray(chunks) == 1)
    rows = np.asarray(qsl)[one]
    dec = paged_decode_attention_native(q[rows], k, v, tables[one], lens[one], scale=0.125)
    np.testing.assert_array_equal(np.asarray(pre[rows], np.float32), np.asarray(dec, np.float32),
                                  err_msg=f"seed={seed}")


# ----------------------------------------------------------------------------- sliding window

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window,prefixes,chunks", WINDOW_PREFILLS + [(0, (0, 30), (13, 4))])
def test_sliding_window_matches_reference(seed, dtype, window, prefixes, chunks, attention_tiles):
    """A window (traced in a layer scan, as the model passes it) in prefill and decode, the table entries wholly
    before it garbage (the KV cache manager frees those blocks); window 0 is none. Windows run on the vector
    tiles (AttentionTiles), whatever the CPU."""
    rng = np.random.default_rng(seed)
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype, scale=0.125, soft_cap=20.0)
    check_window_prefill(seed, rng, prefixes, chunks, window, under_layer_scan(paged_prefill_attention_native),
                         num_padding=3, what="native prefill", **shape)
    check_window_decode(seed, rng, [p + c for p, c in zip(prefixes, chunks)], window,
                        under_layer_scan(paged_decode_attention_native), what="native decode", **shape)


# ----------------------------------------------------------------------------- attention sinks

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap)
SINK_CASES = [
    (8, 2, 64, 16, jnp.float32, None),     # group 4: the AVX-512 / AVX2 prefill and decode tiles
    (6, 2, 64, 8, jnp.bfloat16, 20.0),     # group 3: the decode tiles' twin slot; soft cap
    (7, 1, 52, 8, jnp.float32, 10.0),      # group 7, head_dim 52: the vector tiles only
]


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", SINK_CASES)
def test_sinks_match_reference(seed, hq, hkv, d, bs, dtype, cap, window, attention_tiles):
    """Random sinks (+10, +5, -4 and random ones) in prefill (several query tiles, one-token chunks on the decode
    tiles, padding) and decode (heads split over work items, context 0), every tile kind; with a window (the
    vector tiles) and without. Outputs land in NaN-poisoned buffers."""
    rng = np.random.default_rng(seed)
    sinks = random_sinks(rng, hq)
    shape = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                 soft_cap=cap, sinks=sinks)
    prefixes, chunks = zip(*native_prefill_batch(bs))
    check_window_prefill(seed, rng, prefixes, chunks, window, POISONED_PREFILL, num_padding=3,
                         what="native prefill sinks", **shape)
    check_window_decode(seed, rng, [0, 1, bs + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))], window,
                        functools.partial(run_poisoned, paged_decode_attention_native), what="native decode sinks",
                        **shape)


def test_sinks_with_a_traced_window(seed):
    """The sinks beside a window traced in a layer scan, as the model passes them."""
    rng = np.random.default_rng(seed)
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=jnp.float32, scale=0.125,
                 soft_cap=20.0, sinks=random_sinks(rng, 4))
    prefixes, chunks = WINDOW_PREFILLS[0][1:]
    check_window_prefill(seed, rng, prefixes, chunks, 5, under_layer_scan(paged_prefill_attention_native),
                         num_padding=3, what="native prefill", **shape)
    check_window_decode(seed, rng, [p + c for p, c in zip(prefixes, chunks)], 5,
                        under_layer_scan(paged_decode_attention_native), what="native decode", **shape)


def test_sinks_of_the_wrong_shape_are_refused():
    q = jnp.zeros((2, 4, 8), jnp.float32)
    cache = jnp.zeros((3, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention_native(q, cache, cache, jnp.ones((2, 1), jnp.int32), jnp.ones((2,), jnp.int32),
                                      scale=1.0, sinks=jnp.zeros((2,), jnp.float32))


# ----------------------------------------------------------------------------- API and build


def test_rejects_unsupported_dtypes():
    q = jnp.zeros((1, 2, 64), jnp.bfloat16)
    pages = jnp.zeros((2, 8, 1, 64), jnp.float32)
    tables, lens = jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 pages under float32 q"):  # bf16 q over f32 pages
        paged_decode_attention_native(q, pages, pages, tables, lens, scale=1.0)
    with pytest.raises(ValueError):
        paged_decode_attention_native(q.astype(jnp.float16), pages.astype(jnp.float16),
                                      pages.astype(jnp.float16), tables, lens, scale=1.0)
    with pytest.raises(ValueError):  # k and v of different dtypes
        paged_decode_attention_native(q.astype(jnp.float32), pages, pages.astype(jnp.bfloat16), tables, lens,
                                      scale=1.0)
    assert native.supports(jnp.bfloat16, jnp.bfloat16) and native.supports(jnp.float32, jnp.bfloat16)
    assert not native.supports(jnp.bfloat16, jnp.float32) and not native.supports(jnp.float16, jnp.float16)


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI installs fresh (a developer may "
                    "have edited the .cc since, which the first-use build covers)")
def test_ci_uses_the_install_time_build():
    assert library.library_path() == library.PACKAGE_LIBRARY, (
        f"loaded {library.library_path()}, not the library `pip install` should have built: does "
        f"pyproject.toml's [build-system] requires list jax and jaxlib (the FFI headers)?")


def test_kernel_rejects_inconsistent_shapes():
    """Shape checks in the handler come back as errors, not crashes."""
    q = jnp.zeros((2, 4, 64), jnp.float32)
    k = jnp.zeros((3, 8, 2, 64), jnp.float32)
    tables, lens = jnp.ones((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(Exception, match="differ in shape"):
        jax.block_until_ready(paged_decode_attention_native(q, k, k[:, :4], tables, lens,
                                                            scale=1.0))
    with pytest.raises(Exception, match="multiple of num_kv_heads"):
        jax.block_until_ready(paged_decode_attention_native(q[:, :3], k, k, tables, lens,
                                                            scale=1.0))
    with pytest.raises(Exception, match="query_start_loc"):
        jax.block_until_ready(paged_prefill_attention_native(
            q, k, k, tables, lens, jnp.zeros((2,), jnp.int32), scale=1.0))


@pytest.mark.skipif(library.find_compiler() is None, reason="no C++ compiler to rebuild with")
def test_build_from_source_and_stale_check(tmp_path, monkeypatch):
    """The first-use / `--build` path compiles, and a library from other source is refused (an error when
    FERRY_NATIVE_ATTENTION_LIB names it, not the reference's silent fallback)."""
    out = library.build(tmp_path / "lib.so")
    lib, why = library._open(out)
    assert lib is not None, why
    monkeypatch.setattr(library, "_jaxlib_version", lambda: "0.1.0")  # older than the headers
    lib, why = library._open(out)
    assert lib is None and "newer than the running" in why, why
    monkeypatch.undo()
    monkeypatch.setenv("FERRY_NATIVE_ATTENTION_LIB", str(out))  # asked for by name: it loads ...
    lib, path, why = library._locate()
    assert lib is not None and path == out and why == "", why
    monkeypatch.setattr(library, "source_hash", lambda *a: "0123456789abcdef")
    lib, why = library._open(out)
    assert lib is None and "stale" in why, why
    with pytest.raises(RuntimeError, match="FERRY_NATIVE_ATTENTION_LIB=.*stale"):  # ... or says why not
        library._locate()
