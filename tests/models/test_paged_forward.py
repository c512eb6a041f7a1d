"""The paged step writes K/V in place into a donated cache; padding writes only into the null block."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.worker.packing import SeqSlice, StepLayout, pack
from engine.worker.step import model_step
from helpers.paged_driver import paged_greedy, rel_err
from models.config import ModelConfig
from models.loading import random_model
from models.paged import init_kv_cache
from pallas_kernels.kernels import Kernels, default_attention

CFG = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
BLOCK = 4


def _kernels(model, kv_dtype=None, attention=None) -> Kernels:
    return Kernels.for_platform("cpu", model.dtype, kv_dtype or model.dtype, attention)


def _step(model, cache, seqs, layout):
    return model_step(model.graphdef, model.state, cache, pack(seqs, layout, BLOCK), layout,
                      _kernels(model, cache[0].dtype))


@pytest.mark.parametrize("dtype,layout,seqs", [
    (jnp.float32, StepLayout(16, 2, 4, 2, decode=False), [SeqSlice([5, 6, 7], 0, [3, 9])]),
    (jnp.bfloat16, StepLayout(16, 2, 4, 2, decode=False), [SeqSlice([5, 6, 7], 0, [3, 9])]),
    (jnp.float32, StepLayout(1, 1, 4, 1, decode=True), [SeqSlice([5], 6, [3, 9])]),  # batch-1 decode
], ids=["f32", "bf16", "f32-one-token"])
def test_cache_update_reuses_the_donated_buffer(dtype, layout, seqs):
    """The stacked [L, ...] cache is donated and written in place: same buffers out, and the compiled
    step (a scan over layers) holds no copy or conversion of it (pallas_kernels/ops.write_kv: XLA CPU's own
    16-bit scatter widened the whole pool, and its one-token scatter became a dynamic-update-slice
    behind a copy of the whole pool)."""
    model = random_model(CFG)
    cache = init_kv_cache(CFG.num_layers, 16, BLOCK, CFG.num_kv_heads, CFG.head_dim, dtype)
    pointers = [pages.unsafe_buffer_pointer() for pages in cache]
    hlo = model_step.lower(model.graphdef, model.state, cache, pack(seqs, layout, BLOCK), layout,
                           _kernels(model, dtype)).compile().as_text()
    cache_shape = "[" + ",".join(map(str, cache[0].shape)) + "]"
    # The layers' pages as one pool inside the scan, by block or by slot.
    rows = f"{CFG.num_kv_heads},{CFG.head_dim}]"
    pool_shapes = (f"[{CFG.num_layers * 16},{BLOCK},{rows}", f"[{CFG.num_layers * 16 * BLOCK},{rows}")
    copies = [line for line in hlo.splitlines() if " copy(" in line or "copy-start" in line or " convert(" in line]
    assert not [c for c in copies if cache_shape in c or any(s in c for s in pool_shapes)], copies
    assert "while" in hlo, "the layers should run as one loop"
    _, new_cache = _step(model, cache, seqs, layout)
    assert all(pages.is_deleted() for pages in cache), "the old cache must be donated"
    assert [pages.unsafe_buffer_pointer() for pages in new_cache] == pointers


def test_padding_tokens_change_nothing_outside_the_null_block():
    rng = np.random.default_rng()
    model = random_model(CFG, seed=int(rng.integers(1 << 30)))
    shape = (CFG.num_layers, 16, BLOCK, CFG.num_kv_heads, CFG.head_dim)
    cache = tuple(jax.numpy.asarray(rng.normal(size=shape), np.float32) for _ in range(2))
    before = [np.asarray(pages) for pages in cache]
    # Two real sequences (5 and 2 tokens) in a 16-row step with 4 sequence rows: 9 padding tokens.
    seqs = [SeqSlice(rng.integers(0, 128, 5).tolist(), 0, [7, 2]), SeqSlice([11, 12], 0, [12])]
    written = {(7, i) for i in range(4)} | {(2, 0), (12, 0), (12, 1)}
    _, cache = _step(model, cache, seqs, StepLayout(16, 4, 2, 4, decode=False))
    for old, new in zip(before, cache):
        new = np.asarray(new)
        for layer in range(CFG.num_layers):
            for block in range(1, 16):
                for slot in range(BLOCK):
                    same = np.array_equal(old[layer, block, slot], new[layer, block, slot])
                    assert same != ((block, slot) in written), (layer, block, slot)


@pytest.mark.parametrize("impl", ["pallas_interpret", "native", "pallas_tpu_interpret"])
def test_model_forward_with_kernels_matches_reference_path(impl):
    """The whole model (batched prefill of three prompts, then decode) through a kernel gives the
    reference path's logits."""
    rng = np.random.default_rng()
    cfg = dataclasses.replace(CFG, num_kv_heads=1, head_dim=16)  # MQA, group of 4
    model = random_model(cfg, seed=int(rng.integers(1 << 30)))
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 9, 14)]
    ref = paged_greedy(model, prompts, 4, block_size=BLOCK, attention_impl="reference")
    got = paged_greedy(model, prompts, 4, block_size=BLOCK, attention_impl=impl)
    for a, b in zip(got.prompt_logits + got.step_logits, ref.prompt_logits + ref.step_logits):
        assert rel_err(a, b) < 1e-5
    assert got.tokens == ref.tokens


def test_float32_model_over_bfloat16_cache():
    """A bf16 KV cache under a float32 model: the default CPU impl (the native kernel, f32 queries over
    bf16 pages) gives the reference path's float32 logits on the same bf16 cache."""
    assert default_attention("cpu", np.float32, jnp.bfloat16) == "native"
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    model = random_model(CFG, seed=seed)
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 14)]
    ref = paged_greedy(model, prompts, 4, block_size=BLOCK, attention_impl="reference", kv_dtype=jnp.bfloat16)
    got = paged_greedy(model, prompts, 4, block_size=BLOCK, kv_dtype=jnp.bfloat16)
    # Typically 2e-7 apart; where the two paths' float32 K/V round to neighbouring bf16 values (a one-ulp
    # flip, 2^-8 relative, in one element of the cache), that flip carries on into the later layers: up to
    # 2.5e-5 seen in CI.
    for a, b in zip(got.prompt_logits + got.step_logits, ref.prompt_logits + ref.step_logits):
        assert a.dtype == np.float32 and rel_err(a, b) < 1e-4, f"seed {seed}"
    assert got.tokens == ref.tokens


def _model_form(form, cfg, dtype, seed):
    """random_model's scanned layers, the same with its kernels packed (as the engine does on CPU), or unrolled."""
    from flax import nnx  # noqa: PLC0415

    from models.loading import LoadedModel  # noqa: PLC0415
    from models.transformer import Transformer, pack_kernels  # noqa: PLC0415

    if form == "unrolled":
        graphdef, state = nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed), scan=False))
        return LoadedModel(cfg, graphdef, state, cfg.max_position_embeddings)
    model = random_model(cfg, dtype, seed=seed)
    if form == "packed":
        model = dataclasses.replace(model, state=pack_kernels(model.graphdef, model.state))
    return model


@pytest.mark.parametrize("form,dtype,impl", [
    ("scanned", jnp.float32, "reference"), ("packed", jnp.float32, "native"), ("packed", jnp.bfloat16, "native"),
    ("unrolled", jnp.float32, "native"), ("scanned", jnp.float32, "pallas_interpret"),
    ("scanned", jnp.float32, "pallas_tpu_interpret"),  # the TPU kernel writes the K/V rows itself
])
def test_last_layer_runs_the_logits_rows_alone(form, dtype, impl):
    """A step taking one logits row per sequence (the engine's prefill and mixed steps) runs its last layer
    past the K/V write on those rows alone (Transformer.__call__). Its logits are those rows' logits from the
    same step taking every row's (where every row runs every layer), and its cache is that step's, bit for
    bit, the last layer's K/V included. The step mixes a decode row, a prompt's first chunk, a later chunk,
    and a padding sequence, over a cache of random earlier K/V."""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    model = _model_form(form, CFG, dtype, seed)
    tokens = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()  # noqa: E731
    seqs = [SeqSlice(tokens(1), 9, [4, 11, 6]),          # a decode row after 9 cached tokens
            SeqSlice(tokens(7), 0, [2, 8]),              # a prompt's first chunk (not its last)
            SeqSlice(tokens(6), 5, [13, 1, 7])]          # a prompt's second chunk, after 5 cached tokens
    kernels = Kernels.for_platform("cpu", dtype, dtype, impl)
    shape = (CFG.num_layers, 16, BLOCK, *kernels.kv_page_dims(CFG.num_kv_heads, CFG.head_dim, dtype))
    earlier = [rng.normal(size=shape).astype(np.float32) for _ in range(2)]
    last_rows = np.cumsum([len(s.token_ids) for s in seqs]) - 1

    def run(layout, all_logits):
        cache = tuple(jnp.asarray(pages, dtype) for pages in earlier)
        buf = pack(seqs, layout, BLOCK, all_logits=all_logits)
        logits, cache = model_step(model.graphdef, model.state, cache, buf, layout, kernels)
        return np.asarray(logits, np.float32), [np.asarray(pages.astype(jnp.float32)) for pages in cache]

    got, got_cache = run(StepLayout(16, 4, 3, 4, decode=False), all_logits=False)
    want, want_cache = run(StepLayout(16, 4, 3, 16, decode=False), all_logits=True)
    # bf16: the last layer's attention by the decode kernel, rounded to bf16 apart from the prefill kernel's
    assert rel_err(got[:len(seqs)], want[last_rows]) < (1e-5 if dtype == jnp.float32 else 2e-2)
    for a, b in zip(got_cache, want_cache):  # but the null block, where padding rows write what they hold
        np.testing.assert_array_equal(a[:, 1:], b[:, 1:])


@pytest.mark.parametrize("platform,barriers", [("cpu", 1), ("tpu", 0), ("gpu", 0)])
def test_layer_weights_copied_only_on_the_cpu(platform, barriers):
    """The scanned layers' parameters pass an optimization barrier on the CPU only (there it keeps XLA CPU's dots
    library calls). On an accelerator the barrier would copy every layer's weights out of the stack each step,
    where the dots read them in place; scripts/aot_compile.py shows it in a TPU decode step's temporaries."""
    model = random_model(CFG, jnp.float32, seed=0)
    layout = StepLayout(4, 4, 3, 4, decode=True)
    seqs = [SeqSlice([5], 3, [1, 2, 3])]
    cache = init_kv_cache(CFG.num_layers, 8, BLOCK, CFG.num_kv_heads, CFG.head_dim, jnp.float32)
    kernels = Kernels(platform, "reference", native=False)
    jaxpr = jax.make_jaxpr(lambda state, cache, buf: model_step(model.graphdef, state, cache, buf, layout, kernels))(
        model.state, cache, pack(seqs, layout, BLOCK))
    assert str(jaxpr).count("optimization_barrier") == barriers
