"""The Mosaic TPU ragged paged-attention kernel (pallas_kernels/tpu/ragged_paged_attention.py), checked on CPU
both ways:

  * run in the TPU interpreter (pltpu.InterpretParams: DMAs and semaphores simulated, VMEM scratch
    starts as NaN, out-of-bounds reads raise) against the plain-jnp references, on random shapes
    with shuffled block tables and NaN in every cache slot no sequence owns (tests/helpers/attention_cases.py);
    some cases with the interpreter's race detector on, which must find no race, and a
    single-buffered variant that must be caught;
  * lowered for TPU from this CPU host (jax.export, platforms=["tpu"], under an abstract TPU v6e
    device: pallas_kernels/lowering.py) at the attention shapes of real models: the module must
    carry the Mosaic `tpu_custom_call`. What this does not prove: Mosaic's own compilation of that
    call (layouts, VMEM limits) runs inside the TPU compiler; scripts/tpu_check.py covers it on a TPU.

A semaphore deadlock (a DMA wait without its start) hangs the interpreter instead of failing, so
every interpreter test runs under a watchdog (faulthandler, stdlib) that dumps the stacks and ends
the process after DEADLOCK_TIMEOUT_S rather than letting CI hang.
"""

import faulthandler
import functools
import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from helpers.attention_cases import (
    WINDOW_PREFILLS,
    assert_zero_rows,
    check_close,
    check_prefill,
    check_window_decode,
    check_window_prefill,
    check_window_through_dispatch,
    decode_inputs,
    drop_blocks_before_window,
    prefill_batch,
    prefill_inputs,
    random_sinks,
    under_layer_scan,
)
from helpers.repo import ROOT
from pallas_kernels.attention import paged_attention
from pallas_kernels.lowering import MODEL_HEAD_SHAPES, TPU_CALL_TARGET, export_for
from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from pallas_kernels.tpu import ragged_paged_attention as tpu_attention
from pallas_kernels.tpu.ragged_paged_attention import (
    check_smem,
    page_head_dim,
    ragged_paged_attention_tpu,
    smem_bytes,
    sublane_multiple,
    write_kv_and_attend_tpu,
)

DEADLOCK_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def deadlock_watchdog():
    faulthandler.dump_traceback_later(DEADLOCK_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _race_state():
    """The TPU interpreter's race-detection state (private module; None if this jax moved it)."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(interpret_pallas_call, "races", None)


def _interpret(detect_races: bool):
    return pltpu.InterpretParams(detect_races=detect_races)


def _assert_no_races(detect_races: bool, seed):
    if detect_races:
        races = _race_state()
        assert races is not None, "race detection was asked for but left no state"
        assert not races.races_found, f"the TPU interpreter found a data race seed={seed}"


# ----------------------------------------------------------------------------- interpret mode

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, pages_per_block, races)
DECODE_CASES = [
    (2, 2, 64, 8, jnp.float32, None, 2, True),     # MHA, head_dim 64 padded to 128 lanes
    (8, 2, 80, 16, jnp.bfloat16, 30.0, 1, False),  # group 4, head_dim 80, soft cap, 1 page a DMA block
    (7, 1, 128, 8, jnp.float32, 10.0, 3, False),   # MQA, group 7, 3-page blocks (ragged last block)
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,ppb,races", DECODE_CASES)
def test_decode_matches_reference(seed, hq, hkv, d, bs, dtype, cap, ppb, races):
    rng = np.random.default_rng(seed)
    # context 0 (padding row), 1, one full page, one page + 1, several pages, random.
    ctx = [0, 1, bs, bs + 1, 5 * bs + 3, int(rng.integers(1, 4 * bs))]
    q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          block_size=bs, dtype=dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=d ** -0.5, soft_cap=cap)
    out = ragged_paged_attention_tpu(q, k, v, tables, lens, decode=True, scale=d ** -0.5,
                                     soft_cap=cap, pages_per_block=ppb,
                                     interpret=_interpret(races))
    check_close(out, ref, dtype, seed, f"tpu decode ppb={ppb}")
    assert_zero_rows(out, 0, "context-0 row", seed)
    _assert_no_races(races, seed)


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, pages_per_block, races)
PREFILL_CASES = [
    (4, 2, 96, 16, jnp.bfloat16, 20.0, 2, True),   # group 2, head_dim 96, soft cap
    (4, 1, 80, 8, jnp.float32, 5.0, 3, False),     # MQA group 4, head_dim 80
    (8, 1, 256, 16, jnp.bfloat16, None, 1, False),  # MQA group 8, head_dim 256 (two lane tiles)
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,ppb,races", PREFILL_CASES)
def test_prefill_matches_reference(seed, hq, hkv, d, bs, dtype, cap, ppb, races):
    """Chunks behind cached prefixes, a chunk crossing pages, an empty chunk, padding rows; small
    query blocks so chunks span several blocks and blocks hold several sequences."""
    rng = np.random.default_rng(seed)
    prefixes, chunks = zip(*prefill_batch(bs))
    kernel = functools.partial(ragged_paged_attention_tpu, decode=False, pages_per_block=ppb,
                               block_q=sublane_multiple(dtype), interpret=_interpret(races))
    check_prefill(seed, rng, prefixes, chunks, kernel, num_padding=3, num_q_heads=hq,
                  num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                  soft_cap=cap, what="tpu prefill")
    _assert_no_races(races, seed)


def test_through_dispatch(seed):
    """impl="pallas_tpu_interpret" reaches the kernel with its default blocks; random lengths."""
    rng = np.random.default_rng(seed)
    bs = 16
    prefixes = rng.integers(0, 4 * bs, size=3)
    chunks = rng.integers(1, 24, size=3)
    check_prefill(seed, rng, prefixes, chunks,
                  functools.partial(paged_attention, decode=False, impl="pallas_tpu_interpret"),
                  reference=functools.partial(paged_attention, decode=False, impl="reference"),
                  num_padding=5, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs,
                  dtype=jnp.float32, scale=0.125, soft_cap=8.0, what="tpu prefill dispatch")
    q, k, v, tables, lens = decode_inputs(rng, [int(c) for c in rng.integers(0, 5 * bs, size=4)],
                                          num_q_heads=8, num_kv_heads=2, head_dim=64,
                                          block_size=bs, dtype=jnp.float32)
    ref = paged_attention(q, k, v, tables, lens, None, decode=True, scale=0.125, impl="reference")
    out = paged_attention(q, k, v, tables, lens, None, decode=True, scale=0.125,
                          impl="pallas_tpu_interpret")
    check_close(out, ref, jnp.float32, seed, "tpu decode dispatch")


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window, pages_per_block, races, traced)
WINDOW_DECODE_CASES = [
    (4, 2, 64, 8, jnp.float32, None, 5, 2, True, False),      # GQA, a window not a multiple of the page, races
    (8, 1, 80, 16, jnp.bfloat16, 30.0, 16, 1, False, True),   # MQA, soft cap, one-page window, traced
    (7, 1, 128, 8, jnp.float32, 10.0, 21, 3, False, True),    # MQA group 7, 3-page blocks, traced
    (2, 2, 64, 8, jnp.float32, 5.0, 0, 2, False, True),       # window 0: none
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window,ppb,races,traced", WINDOW_DECODE_CASES)
def test_decode_sliding_window(seed, hq, hkv, d, bs, dtype, cap, window, ppb, races, traced):
    """Each sequence's K/V blocks (and the prefetch of its first from the sequence before) start at its window's
    first page: the garbage table entries before it would be out-of-bounds reads, which the interpreter raises."""
    rng = np.random.default_rng(seed)
    ctx = [0, 3, window + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))]
    kernel = functools.partial(ragged_paged_attention_tpu, decode=True, pages_per_block=ppb,
                               interpret=_interpret(races))
    check_window_decode(seed, rng, ctx, window, under_layer_scan(kernel) if traced else kernel, num_q_heads=hq,
                        num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5, soft_cap=cap,
                        what=f"tpu decode ppb={ppb}")
    _assert_no_races(races, seed)


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, pages_per_block)
WINDOW_PREFILL_DIMS = [
    (4, 2, 96, 16, jnp.bfloat16, 20.0, 2),   # GQA, soft cap
    (4, 1, 80, 8, jnp.float32, None, 3),     # MQA, 3-page blocks
]


@pytest.mark.parametrize("window,prefixes,chunks", WINDOW_PREFILLS)
@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,ppb", WINDOW_PREFILL_DIMS)
def test_prefill_sliding_window(seed, hq, hkv, d, bs, dtype, cap, ppb, window, prefixes, chunks):
    """Small query blocks holding several sequences, each visit starting at its own window's first page; the
    window traced inside a layer scan."""
    rng = np.random.default_rng(seed)
    kernel = functools.partial(ragged_paged_attention_tpu, decode=False, pages_per_block=ppb,
                               block_q=sublane_multiple(dtype), interpret=True)
    check_window_prefill(seed, rng, prefixes, chunks, window, under_layer_scan(kernel), num_padding=3,
                         num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                         scale=d ** -0.5, soft_cap=cap, what="tpu prefill")


@pytest.mark.parametrize("window", [0, 7])
def test_sliding_window_through_dispatch(seed, window):
    """impl="pallas_tpu_interpret" passes the window on, default blocks; window 0 means none."""
    check_window_through_dispatch(seed, window, "pallas_tpu_interpret", jnp.float32, num_seqs=3)


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window, pages_per_block)
SINK_DECODE_CASES = [
    (8, 2, 64, 8, jnp.float32, None, 0, 2),       # group 4, no window
    (7, 1, 128, 8, jnp.bfloat16, 10.0, 21, 3),    # MQA group 7, soft cap, window, 3-page blocks
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window,ppb", SINK_DECODE_CASES)
def test_decode_sinks(seed, hq, hkv, d, bs, dtype, cap, window, ppb):
    """Random sinks (+10, +5, -4 and random ones) start each head's rows; context-0 rows stay zeros."""
    rng = np.random.default_rng(seed)
    kernel = functools.partial(ragged_paged_attention_tpu, decode=True, pages_per_block=ppb, interpret=True)
    check_window_decode(seed, rng, [0, 1, window + 1, 9 * bs + 5, int(rng.integers(1, 12 * bs))], window, kernel,
                        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5,
                        soft_cap=cap, sinks=random_sinks(rng, hq), what=f"tpu decode sinks ppb={ppb}")


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, soft_cap, window, pages_per_block)
SINK_PREFILL_CASES = [
    (4, 2, 96, 16, jnp.bfloat16, 20.0, 0, 2),     # group 2, soft cap, no window
    (6, 2, 80, 8, jnp.float32, None, 5, 3),       # group 3, window
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype,cap,window,ppb", SINK_PREFILL_CASES)
def test_prefill_sinks(seed, hq, hkv, d, bs, dtype, cap, window, ppb):
    """Small query blocks holding several sequences: a row's sink-started state must survive the other
    sequences' visits."""
    rng = np.random.default_rng(seed)
    prefixes, chunks = zip(*prefill_batch(bs))
    kernel = functools.partial(ragged_paged_attention_tpu, decode=False, pages_per_block=ppb,
                               block_q=sublane_multiple(dtype), interpret=True)
    check_window_prefill(seed, rng, prefixes, chunks, window, kernel, num_padding=3, num_q_heads=hq,
                         num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, scale=d ** -0.5, soft_cap=cap,
                         sinks=random_sinks(rng, hq), what="tpu prefill sinks")


def test_sinks_through_dispatch(seed):
    """impl="pallas_tpu_interpret" passes the sinks on, default blocks, under a window."""
    check_window_through_dispatch(seed, 7, "pallas_tpu_interpret", jnp.float32, num_seqs=3, with_sinks=True)


def test_single_buffering_is_caught(seed, monkeypatch):
    """With one K/V buffer the next block's copy lands in the buffer being read (and the two
    blocks' copies share one semaphore): the comparison must catch it, so the double-buffered
    path the other tests pass is really exercised. (The interpreter's race detector tracks
    races between cores; with one core it does not flag this, hence the value check.)"""
    rng = np.random.default_rng(seed)
    q, k, v, tables, lens = decode_inputs(rng, [9, 20, 31], num_q_heads=2, num_kv_heads=1,
                                          head_dim=48, block_size=8, dtype=jnp.float32)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, scale=0.1)
    monkeypatch.setattr(tpu_attention, "NUM_BUFFERS", 1)
    # head_dim 48 is used nowhere else, so this trace is fresh and sees one buffer.
    out = np.asarray(ragged_paged_attention_tpu(q, k, v, tables, lens, decode=True, scale=0.1,
                                                pages_per_block=1, interpret=True))
    assert not np.allclose(out, np.asarray(ref), atol=1e-3, equal_nan=False), f"seed={seed}"


def _new_rows_slots(tables, lens, qsl, block_size):
    """The cache slot of every query row's own token (a chunk's rows are its sequence's last tokens); rows past
    qsl[-1] (padding) go to the null block's slot 0."""
    tables, lens, qsl = np.asarray(tables), np.asarray(lens), np.asarray(qsl)
    slots = []
    for s in range(len(lens)):
        for pos in range(lens[s] - (qsl[s + 1] - qsl[s]), lens[s]):
            slots.append(tables[s, pos // block_size] * block_size + pos % block_size)
    return np.asarray(slots, np.int32)


@pytest.mark.parametrize("window,with_sinks", [(None, False), (5, False), (5, True)],
                         ids=["no-window", "window", "window-sinks"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_write_kv_and_attend(seed, decode, window, with_sinks):
    """The fused kernel writes this step's K/V rows into their slots (the padded pages otherwise unchanged, the
    padding lanes zero) and attends over them: the same pages as the XLA scatter, the same output as the
    reference over those pages. Head_dim 80: the pages carry 48 padding lanes. Under a sliding window the
    table entries before each window hold garbage (the rows' slots come from the intact tables); with_sinks:
    random attention sinks too."""
    rng = np.random.default_rng(seed)
    hq, hkv, d, bs, dtype = 4, 2, 80, 8, jnp.float32
    sinks = random_sinks(rng, hq) if with_sinks else None
    if decode:
        q, k, v, tables, lens = decode_inputs(rng, [1, bs, 2 * bs + 3, 5], num_q_heads=hq, num_kv_heads=hkv,
                                              head_dim=d, block_size=bs, dtype=dtype)
        qsl = jnp.arange(len(lens) + 1, dtype=jnp.int32)
        num_padding = 0
    else:
        prefixes, chunks = zip(*prefill_batch(bs))
        num_padding = 3
        q, k, v, tables, lens, qsl = prefill_inputs(rng, prefixes, chunks, num_padding=num_padding,
                                                    num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                                    dtype=dtype)
    slots = np.concatenate([_new_rows_slots(tables, lens, qsl, bs), np.zeros(num_padding, np.int32)])
    new_k = jnp.asarray(rng.standard_normal((len(slots), hkv, d)), dtype)
    new_v = jnp.asarray(rng.standard_normal((len(slots), hkv, d)), dtype)
    flat = lambda pages, new: pages.reshape(-1, hkv, d).at[slots].set(new).reshape(pages.shape)  # noqa: E731
    k_ref, v_ref = flat(k, new_k), flat(v, new_v)
    if decode:
        ref = paged_decode_attention_ref(q, k_ref, v_ref, tables, lens, scale=d ** -0.5, sliding_window=window,
                                         sinks=sinks)
    else:
        ref = paged_prefill_attention_ref(q, k_ref, v_ref, tables, lens, qsl, scale=d ** -0.5,
                                          sliding_window=window, sinks=sinks)
    if window:
        tables = drop_blocks_before_window(rng, tables, lens, np.diff(np.asarray(qsl)), window, bs)
    pad = ((0, 0), (0, 0), (0, 0), (0, page_head_dim(d) - d))
    out, k_out, v_out = write_kv_and_attend_tpu(
        q, new_k, new_v, jnp.pad(k, pad), jnp.pad(v, pad), jnp.asarray(slots), tables, lens,
        None if decode else qsl, decode=decode, scale=d ** -0.5, sliding_window=window, sinks=sinks,
        pages_per_block=2,
        block_q=None if decode else sublane_multiple(dtype), interpret=True)
    check_close(out, ref, dtype, seed, "fused K/V write + attention")
    if num_padding:
        assert_zero_rows(out, slice(-num_padding, None), "padding rows", seed)
    for got, want in ((k_out, k_ref), (v_out, v_ref)):
        # NaN where no sequence owns a slot: equal as arrays (NaN == NaN here), padding lanes still zero. Not the
        # null block: the padding rows all write its slot 0, in an order the scatter leaves undefined.
        np.testing.assert_array_equal(np.asarray(got)[1:, ..., :d], np.asarray(want)[1:], err_msg=f"seed={seed}")
        assert (np.asarray(got)[..., d:] == 0).all(), f"padding lanes written seed={seed}"


def test_smem_limit_names_the_flags():
    # tables, lengths, query starts, block ranges, new rows' slots, and the sliding window's word
    assert smem_bytes(2, 3, 4, 5) == 4 * (2 * 3 + 2 + 3 + 2 * 4 + 5 + 1)
    check_smem(64, 512, 512)  # 64 sequences of 8k tokens at page 16: fits
    with pytest.raises(ValueError, match="--max_model_len.*--block_size"):
        check_smem(64, 8192, 512)  # 128k tokens at page 16: 2 MiB of block tables


def test_bad_block_q_names_the_field():
    q = jnp.zeros((8, 2, 64), jnp.bfloat16)
    cache = jnp.zeros((4, 8, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention_tpu(q, cache, cache, jnp.zeros((1, 2), jnp.int32),
                                   jnp.ones((1,), jnp.int32), jnp.asarray([0, 8], jnp.int32),
                                   decode=False, scale=1.0, block_q=8, interpret=True)


# ----------------------------------------------------------------------------- lowering for TPU

NUM_BLOCKS, BLOCK_SIZE, NUM_SEQS, TABLE_WIDTH, NUM_TOKENS = 512, 16, 8, 64, 256


@pytest.mark.parametrize("model", list(MODEL_HEAD_SHAPES))
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_lowers_for_tpu(model, decode):
    hq, hkv, d = MODEL_HEAD_SHAPES[model]
    soft_cap = 50.0 if model.startswith("gemma") else None
    cache = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, hkv, d), jnp.bfloat16)
    specs = (jax.ShapeDtypeStruct((NUM_SEQS if decode else NUM_TOKENS, hq, d), jnp.bfloat16),
             cache, cache, jax.ShapeDtypeStruct((NUM_SEQS, TABLE_WIDTH), jnp.int32),
             jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32),
             jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32))

    def f(q, k, v, tables, lens, qsl):
        return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=d ** -0.5,
                               soft_cap=soft_cap, impl="pallas_tpu")

    text = export_for("tpu", f, specs)
    assert TPU_CALL_TARGET in text, f"no {TPU_CALL_TARGET} in the TPU lowering:\n{text[:2000]}"


@pytest.mark.parametrize("model", ["llama3-8b", "gemma-2b"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_lowers_for_tpu_with_window(model, decode):
    """The window as a traced argument (a per-layer value) lowers to the Mosaic call."""
    hq, hkv, d = MODEL_HEAD_SHAPES[model]
    cache = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, hkv, d), jnp.bfloat16)
    specs = (jax.ShapeDtypeStruct((NUM_SEQS if decode else NUM_TOKENS, hq, d), jnp.bfloat16),
             cache, cache, jax.ShapeDtypeStruct((NUM_SEQS, TABLE_WIDTH), jnp.int32),
             jax.ShapeDtypeStruct((NUM_SEQS,), jnp.int32),
             jax.ShapeDtypeStruct((NUM_SEQS + 1,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))

    def f(q, k, v, tables, lens, qsl, window):
        return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=d ** -0.5, soft_cap=50.0,
                               sliding_window=window, impl="pallas_tpu")

    text = export_for("tpu", f, specs)
    assert TPU_CALL_TARGET in text, f"no {TPU_CALL_TARGET} in the TPU lowering:\n{text[:2000]}"


# Compiles the windowed kernel (decode, prefill, and the fused K/V write; attention also with sinks) for one v6e
# chip with libtpu's XLA and Mosaic compilers, in a child process: the pytest process runs on the CPU, and libtpu
# loads in one process at a time (tests/conftest.py).
_COMPILE_FOR_V6E = textwrap.dedent("""
    from scripts.aot_compile import set_tpu_env, tpu_devices
    _, shape = set_tpu_env("v6e:1x1")
    import jax
    import jax.numpy as jnp
    from pallas_kernels.attention import paged_attention, write_kv_and_attend
    from pallas_kernels.kernels import Kernels

    device = tpu_devices("v6e:1x1", shape)[0]
    on_chip = jax.sharding.SingleDeviceSharding(device)
    spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)
    hq, hkv, d, bs, seqs, width, tokens = 8, 2, 128, 16, 8, 64, 256
    cache = spec((512, bs, hkv, d), jnp.bfloat16)
    for decode in (True, False):
        rows = seqs if decode else tokens
        common = (spec((seqs, width)), spec((seqs,)), spec((seqs + 1,)), spec(()))

        def attend(q, k, v, tables, lens, qsl, window, sinks=None):
            return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=0.088, soft_cap=50.0,
                                   sliding_window=window, sinks=sinks, impl="pallas_tpu",
                                   device_kind=device.device_kind)

        def fused(q, k, v, k_pages, v_pages, slots, tables, lens, qsl, window):
            return write_kv_and_attend(q, k, v, k_pages, v_pages, slots, tables, lens, qsl, decode=decode,
                                       scale=0.088, sliding_window=window,
                                       kernels=Kernels("tpu", "pallas_tpu", False, device.device_kind))

        q = spec((rows, hq, d), jnp.bfloat16)
        jax.jit(attend).lower(q, cache, cache, *common).compile()
        jax.jit(attend).lower(q, cache, cache, *common, spec((hq,), jnp.float32)).compile()
        new = spec((rows, hkv, d), jnp.bfloat16)
        jax.jit(fused).lower(q, new, new, cache, cache, spec((rows,)), *common).compile()
        print("compiled", "decode" if decode else "prefill", flush=True)
""")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (the jax 0.11 environment has it: make test-jax011)")
def test_window_compiles_for_v6e():
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_V6E], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    assert proc.returncode == 0 and proc.stdout.count("compiled") == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
