"""The Triton-language paged-attention kernel (pallas_kernels/triton/jax_triton.py) on a CPU host.

* Triton's interpreter runs it on host copies of random inputs (tests/helpers/attention_cases.py:
  shuffled block tables, NaN in every slot no sequence owns, a NaN-filled output buffer) against
  the plain-jnp references, float32 and bfloat16, decode and chunked prefill.
* triton.compile builds it for sm_80 (A100; the pre-Hopper GPUs Colab hands out) and sm_90
  (H100/H200) with no GPU present, at the model head shapes: PTX and cubin must come out.

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
from pallas_kernels.lowering import MODEL_HEAD_SHAPES
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


# ----------------------------------------------------------------------------- sm_80 / sm_90

COMPILE_CASES = (
    [(name, cc) for name in ("llama3-8b", "qwen2.5-7b", "gemma-2b") for cc in (80, 90)]
    + [(name, 80) for name in ("head_dim-64", "head_dim-80", "head_dim-96")])


@pytest.mark.parametrize("name,capability", COMPILE_CASES)
def test_compiles_for_gpu_without_one(name, capability):
    hq, hkv, d = MODEL_HEAD_SHAPES[name]
    for decode, rows in ((True, 8), (False, 256)):
        asm = jt.compile_for_gpu((rows, hq, d), (512, 16, hkv, d), jnp.bfloat16, table_width=64,
                                 num_seqs=8, decode=decode, compute_capability=capability,
                                 scale=d ** -0.5, soft_cap=50.0 if name == "gemma-2b" else None)
        what = f"{name} {'decode' if decode else 'prefill'} sm_{capability}"
        assert f".target sm_{capability}" in asm["ptx"], what
        assert ".entry _ragged_paged_attention_kernel" in asm["ptx"], what
        assert asm["cubin"][:4] == b"\x7fELF", what  # ptxas produced a CUDA binary
        # Within the smallest per-block opt-in shared memory of the targets (sm_86/89: 99 KiB).
        assert asm["shared"] <= 99 * 1024, (what, asm["shared"])


@pytest.mark.parametrize("capability", [80, 90])
def test_sliding_window_compiles_for_gpu(capability):
    """The windowed kernel (the window read from the tile table, not compiled in) builds for both targets."""
    hq, hkv, d = MODEL_HEAD_SHAPES["gemma-2b"]
    for decode, rows in ((True, 8), (False, 256)):
        asm = jt.compile_for_gpu((rows, hq, d), (512, 16, hkv, d), jnp.bfloat16, table_width=64, num_seqs=8,
                                 decode=decode, compute_capability=capability, scale=d ** -0.5, soft_cap=50.0,
                                 windowed=True)
        what = f"windowed {'decode' if decode else 'prefill'} sm_{capability}"
        assert asm["cubin"][:4] == b"\x7fELF", what
        assert asm["shared"] <= 99 * 1024, (what, asm["shared"])


@pytest.mark.parametrize("capability", [80, 90])
def test_sinks_compile_for_gpu(capability):
    """The sinks kernel (its own entry point, one more pointer) builds for both targets, windowed or not."""
    hq, hkv, d = MODEL_HEAD_SHAPES["llama3-8b"]
    for decode, rows, windowed in ((True, 8, False), (False, 256, True)):
        asm = jt.compile_for_gpu((rows, hq, d), (512, 16, hkv, d), jnp.bfloat16, table_width=64, num_seqs=8,
                                 decode=decode, compute_capability=capability, scale=d ** -0.5, windowed=windowed,
                                 has_sinks=True)
        what = f"sinks {'decode' if decode else 'prefill'} sm_{capability}"
        assert ".entry _ragged_paged_attention_sinks_kernel" in asm["ptx"], what
        assert asm["cubin"][:4] == b"\x7fELF", what
        assert asm["shared"] <= 99 * 1024, (what, asm["shared"])


def test_float32_compiles_with_ieee_dots():
    """float32 asks for IEEE dots (Triton's default is TF32): no tf32 MMA in the PTX."""
    asm = jt.compile_for_gpu((8, 32, 128), (512, 16, 8, 128), jnp.float32, table_width=64,
                             num_seqs=8, decode=True, compute_capability=80)
    assert ".tf32" not in asm["ptx"]
    assert asm["cubin"][:4] == b"\x7fELF"


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
