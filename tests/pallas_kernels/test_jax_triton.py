"""The Triton-language paged-attention kernel (pallas_kernels/triton/jax_triton.py) on a CPU host.

* Triton's interpreter runs it on host copies of random inputs (tests/helpers/attention_cases.py:
  shuffled block tables, NaN in every slot no sequence owns, a NaN-filled output buffer) against
  the plain-jnp references, float32 and bfloat16, decode and chunked prefill.
* split-K decode (the partials and their combine) the same way.
What it compiles to on each GPU architecture is tests/pallas_kernels/test_gpu_compile.py's.

jax_triton.triton_call itself is not exercised here: its lowering serializes the call through the
CUDA plugin's Triton extension, which a CPU jaxlib lacks; scripts/gpu_check.py runs it on a GPU.
The interpreter reads buffers through torch, so this file runs in the main (torch) environment.
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
    decode_inputs,
    prefill_batch,
    random_sinks,
)
from pallas_kernels.attention import paged_attention
from pallas_kernels.reference import paged_decode_attention_ref
from pallas_kernels.triton import jax_triton as jt

pytest.importorskip("torch", reason="Triton's interpreter reads buffers through torch")

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap)
DECODE_CASES = [
    (4, 2, 80, 16, jnp.bfloat16, 30.0),     # group 2, head_dim 80, soft cap
    (7, 1, 96, 8, jnp.float32, 10.0),       # MQA, group 7 (not a power of two), head_dim 96
    (8, 1, 256, 16, jnp.bfloat16, None),    # Gemma-2B-like: MQA group 8, head_dim 256
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", DECODE_CASES)
def test_decode_interpreted_matches_reference(seed, hq, hkv, d, bs, dtype, cap):
    rng = np.random.default_rng(seed)
    # context 0 (padding row), 1, one full page, one page + 1, several pages, random.
    ctx = [0, 1, bs, bs + 1, 5 * bs + 3, int(rng.integers(1, 4 * bs))]
    q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=bs, dtype=dtype)
    scale = d ** -0.5
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=scale, soft_cap=cap)
    out = jt.run_interpreted(q, k, v, tables, lens, None, decode=True, scale=scale, soft_cap=cap)
    check_close(out, ref, dtype, seed, "jax-triton decode (interpreter)")
    assert_zero_rows(out, 0, "context-0 row", seed)


# Every other prefill case of the Pallas tests, float32 and bfloat16 both covered.
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", PREFILL_CASES[::2] + PREFILL_CASES[1:2])
def test_prefill_interpreted_matches_reference(seed, hq, hkv, d, bs, dtype, cap):
    rng = np.random.default_rng(seed)
    prefixes, chunks = zip(*prefill_batch(bs))
    # Small query tiles (16 rows) so the 11- and 18-token chunks span several tiles.
    group_padded = 1 << (hq // hkv - 1).bit_length()
    kernel = functools.partial(jt.run_interpreted, decode=False,
                               block_q=max(1, 16 // group_padded))
    check_prefill(seed, rng, prefixes, chunks, kernel, num_padding=3, num_q_heads=hq,
                  num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                  soft_cap=cap, what="jax-triton prefill (interpreter)")


def test_prefill_default_tiling_random_lengths(seed):
    """Default tiles (64 rows for bf16) over random prefix and chunk lengths."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 64, size=4)
    chunks = rng.integers(1, 40, size=4)
    check_prefill(seed, rng, prefixes, chunks, functools.partial(jt.run_interpreted, decode=False),
                  num_padding=5, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=jnp.bfloat16, scale=0.125, soft_cap=8.0, what="jax-triton prefill default")


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window)
WINDOW_DECODE_CASES = [
    (4, 2, 64, 8, jnp.float32, None, 5),       # GQA, a window not a multiple of the page
    (8, 1, 80, 16, jnp.bfloat16, 30.0, 16),    # MQA, soft cap, a one-page window
    (2, 2, 64, 8, jnp.float32, 5.0, 0),        # window 0: none
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window", WINDOW_DECODE_CASES)
def test_decode_sliding_window_interpreted(seed, hq, hkv, d, bs, dtype, cap, window):
    """Garbage in the table entries before each window is never read (the window as a jax int32 scalar)."""
    rng = np.random.default_rng(seed)
    ctx = [0, 3, window + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))]
    kernel = lambda *a, sliding_window, **kw: jt.run_interpreted(  # noqa: E731
        *a, None, decode=True, sliding_window=jnp.int32(sliding_window), **kw)
    check_window_decode(seed, rng, ctx, window, kernel, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                        block_size=bs, dtype=dtype, scale=d ** -0.5, soft_cap=cap,
                        what="jax-triton decode (interpreter)")


@pytest.mark.parametrize("window,prefixes,chunks", WINDOW_PREFILLS)
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap", [(4, 2, 64, 8, jnp.float32, None),
                                                   (4, 1, 96, 16, jnp.bfloat16, 20.0)])
def test_prefill_sliding_window_interpreted(seed, hq, hkv, d, bs, dtype, cap, window, prefixes, chunks):
    """16-row tiles, so a chunk's tiles start at different pages."""
    rng = np.random.default_rng(seed)
    group_padded = 1 << (hq // hkv - 1).bit_length()
    kernel = functools.partial(jt.run_interpreted, decode=False, block_q=max(1, 16 // group_padded))
    check_window_prefill(seed, rng, prefixes, chunks, window, kernel, num_padding=3, num_q_heads=hq,
                         num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                         soft_cap=cap, what="jax-triton prefill (interpreter)")


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window)
SINK_CASES = [
    (4, 2, 64, 8, jnp.float32, None, 0),       # GQA, no window
    (8, 1, 80, 16, jnp.bfloat16, 30.0, 16),    # MQA, soft cap, window
    (6, 2, 64, 8, jnp.float32, 5.0, 5),        # group 3 (padded rows), soft cap, window
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window", SINK_CASES)
def test_sinks_interpreted(seed, hq, hkv, d, bs, dtype, cap, window):
    """Random sinks (+10, +5, -4 and random ones), decode and prefill (16-row tiles), through the sinks kernel."""
    rng = np.random.default_rng(seed)
    shape = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                 soft_cap=cap, sinks=random_sinks(rng, hq))
    decode = lambda *a, sliding_window, **kw: jt.run_interpreted(  # noqa: E731
        *a, None, decode=True, sliding_window=jnp.int32(sliding_window), **kw)
    check_window_decode(seed, rng, [0, 1, window + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))], window,
                        decode, what="jax-triton decode sinks (interpreter)", **shape)
    group_padded = 1 << (hq // hkv - 1).bit_length()
    prefill = functools.partial(jt.run_interpreted, decode=False, block_q=max(1, 16 // group_padded))
    prefixes, chunks = zip(*prefill_batch(bs))
    check_window_prefill(seed, rng, prefixes, chunks, window, prefill, num_padding=3,
                         what="jax-triton prefill sinks (interpreter)", **shape)


def test_bad_shapes_name_the_field():
    q = jnp.zeros((3, 4, 64), jnp.float32)
    k = jnp.zeros((5, 8, 2, 64), jnp.float32)
    tables, lens = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="one row per sequence"):
        jt.run_interpreted(q, k, k, tables, lens, None, decode=True, scale=1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        jt.run_interpreted(q, k, k, tables, lens, jnp.zeros((2,), jnp.int32), decode=False,
                           scale=1.0)


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window, sinks, num_splits)
SPLIT_CASES = [
    (4, 2, 64, 8, jnp.float32, None, None, False, 4),      # no window: the plain split kernel
    (8, 1, 80, 16, jnp.bfloat16, 30.0, 16, False, 8),      # MQA, soft cap, a one-page window
    (6, 2, 64, 8, jnp.float32, 5.0, 0, True, 2),           # group 3, sinks (added by the combine), window 0
    (4, 2, 64, 64, jnp.float32, None, 100, True, 4),       # 64-token pages read 32 keys a step (sub-page tiles)
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window,sinks,splits", SPLIT_CASES)
def test_split_k_decode_interpreted(seed, hq, hkv, d, bs, dtype, cap, window, sinks, splits):
    """Split-K decode (each sequence's keys shared by `splits` programs, then combined) against the reference:
    contexts from empty to many loop steps, so some splits get no keys at all."""
    rng = np.random.default_rng(seed)
    ctx = [0, 1, bs + 1, 9 * bs + 5, 40 * bs + 3, int(rng.integers(1, 40 * bs))]
    shape = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                 soft_cap=cap, sinks=random_sinks(rng, hq) if sinks else None)
    what = f"jax-triton split-K x{splits} (interpreter)"
    if window is None:
        q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                              block_size=bs, dtype=dtype)
        ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=d ** -0.5, soft_cap=cap)
        out = jt.run_interpreted(q, k, v, tables, lens, None, decode=True, scale=d ** -0.5, soft_cap=cap,
                                 num_splits=splits)
        check_close(out, ref, dtype, seed, what)
        assert_zero_rows(out, 0, "context-0 row", seed)
        return
    kernel = lambda *a, sliding_window, **kw: jt.run_interpreted(  # noqa: E731
        *a, None, decode=True, sliding_window=jnp.int32(sliding_window), num_splits=splits, **kw)
    check_window_decode(seed, rng, ctx, window, kernel, what=what, **shape)


def test_split_count_fills_the_gpu():
    """Few sequences x KV heads: enough splits that the (sequence, KV head, split) programs cover an H100's 132
    SMs; many, or short contexts: none."""
    from pallas_kernels.triton.common import choose_num_splits  # noqa: PLC0415

    assert choose_num_splits(4 * 8, max_steps=64, num_cores=132) == 8  # 256 programs
    assert choose_num_splits(1 * 8, max_steps=64, num_cores=132) == 16
    assert choose_num_splits(64 * 8, max_steps=64, num_cores=132) == 1
    assert choose_num_splits(4 * 8, max_steps=4, num_cores=132) == 1  # ~4 steps a split at least
    launch = jt.plan_launch((4, 32, 128), (512, 16, 8, 128), jnp.bfloat16, num_seqs=4, table_width=256,
                            decode=True, scale=0.1, soft_cap=None, num_splits=None)
    assert launch.grid == (4, 8, 8) and launch.kernel is jt._ragged_paged_attention_split_kernel


def test_dispatch_without_jax_triton_says_what_to_install(monkeypatch):
    """impl="jax_triton" where jax-triton does not import: a clear error, not a bare ImportError."""
    import builtins

    real_import = builtins.__import__

    def no_jax_triton(name, *args, **kwargs):
        if name == "jax_triton":
            raise ImportError("No module named 'jax_triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jax_triton)
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    k = jnp.zeros((5, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=r"jax-triton package.*cuda12"):
        paged_attention(q, k, k, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32), None,
                        decode=True, scale=1.0, impl="jax_triton")
