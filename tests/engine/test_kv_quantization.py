"""The quantized KV cache through the engine (EngineConfig.kv_dtype "int8" / "fp8"; pallas_kernels/kv_quant.py):
the flag and the config, the cache's size in the engine's own accounting, greedy tokens against the float cache's
under swap and recompute preemption and with prefix-cache hits, and no compilation after warm-up."""

import numpy as np
import pytest
from absl import flags

from engine.config import EngineConfig
from engine.entrypoints import cli_flags
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.compilation import compile_guard
from engine.worker.kv_cache import kv_bytes_per_block
from models.config import ModelConfig
from models.loading import random_model

# The largest teacher-forced logprob change the cache's quantization may make on the test model (measured
# ~1.5e-3 for int8 and ~9e-3 for fp8): an order of magnitude of headroom. A scale read from the wrong bytes
# moves them by whole nats.
MAX_LOGPROB_CHANGE = {"int8": 0.02, "fp8": 0.1}
CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=3)


def _workload(seed, n=10, system_len=20):
    """Prompts that mostly open with one shared "system prompt" (prefix-cache hits), and their lengths."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, CFG.vocab_size, size=system_len).tolist()
    return [((system if i % 3 else []) + rng.integers(3, CFG.vocab_size, size=int(rng.integers(4, 30))).tolist(),
             int(rng.integers(16, 40))) for i in range(n)]


def _params(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(model, workload, kv_dtype, **config):
    """(outputs, scheduler stats) of the workload, generated twice: with prompt logprobs (which read every prompt
    position: no cache hits), then without, over the cached prefixes."""
    llm = LLM(model, EngineConfig(block_size=8, max_num_seqs=8, max_num_batched_tokens=512, kv_dtype=kv_dtype,
                                  **config))
    outputs = []
    for prompt_logprobs in (1, None):
        outputs += llm.generate([p for p, _ in workload], [_params(m, logprobs=2, prompt_logprobs=prompt_logprobs)
                                                           for _, m in workload], use_tqdm=False)
    return outputs, llm.engine.scheduler.stats()


def test_bad_kv_dtype_is_refused():
    for bad in ("int4", "float64", "fp4", "uint8", "nonsense"):
        with pytest.raises(ValueError, match="kv_dtype .* is not supported: expected int8, fp8"):
            EngineConfig(kv_dtype=bad)
    for good in ("int8", "fp8", "float8_e4m3fn", "bfloat16", "float32", "float16"):
        EngineConfig(kv_dtype=good)
    cli_flags.define_engine_flags()
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["ferry-generate", "--kv_dtype=fp8"])
        assert cli_flags.engine_config_from_flags().kv_dtype == "fp8"
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["ferry-generate", "--kv_dtype=int3"])
        with pytest.raises(ValueError, match="--kv_dtype=int3: kv_dtype 'int3' is not supported"):
            cli_flags.engine_config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def test_quantized_cache_holds_more_blocks_in_the_same_memory(model):
    """Bytes a token: K and V, every layer and KV head, head_dim values and the 4-byte scale for int8 / fp8;
    the same CPU budget then holds that many more blocks."""
    per_token = {dtype: kv_bytes_per_block(CFG, 16, dtype) // 16 for dtype in ("float32", "bfloat16", "int8")}
    rows = 2 * CFG.num_layers * CFG.num_kv_heads
    assert per_token == {"float32": rows * 16 * 4, "bfloat16": rows * 16 * 2, "int8": rows * (16 + 4)}
    engines = {kv: LLMEngine(model, EngineConfig(block_size=16, max_num_seqs=64, max_model_len=256,
                                                 cpu_kv_cache_gib=2**-12, kv_dtype=kv))
               for kv in ("bfloat16", "int8", "fp8")}
    per_token_of = {kv: e.memory["kv_bytes_per_token"] for kv, e in engines.items()}
    assert per_token_of["int8"] == per_token_of["fp8"] == per_token["int8"]
    assert engines["bfloat16"].memory["kv_bytes_per_token"] == per_token["bfloat16"]
    blocks = {kv: e.runner.kv.pages[0].shape[1] for kv, e in engines.items()}
    assert blocks["int8"] == blocks["fp8"] == 2**30 // 2**12 // (16 * per_token["int8"])
    assert blocks["bfloat16"] == 2**30 // 2**12 // (16 * per_token["bfloat16"])
    pages = engines["fp8"].runner.kv.pages[0]
    assert pages.dtype.name == "float8_e4m3fn" and pages.shape[-2:] == (CFG.num_kv_heads, CFG.head_dim + 4)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_greedy_tokens_match_the_float_cache_under_preemption_and_prefix_caching(model, kv_dtype):
    """The float32 cache's run (ample blocks) against the quantized cache's: ample, under swap and under
    recompute preemption, prefix caching on throughout (each workload runs twice: the second time over cached
    blocks, and under preemption blocks come back swapped in or recomputed). The teacher-forced prompt logprobs
    move by at most MAX_LOGPROB_CHANGE, and greedy tokens are the float run's, diverging only where the float
    run's top two logprobs are within twice the largest change measured (reported)."""
    workload = _workload(7)
    want, _ = _run(model, workload, None, num_blocks=256)
    runs = {"ample": _run(model, workload, kv_dtype, num_blocks=256),
            "swap": _run(model, workload, kv_dtype, num_blocks=14, preemption_mode="swap"),
            "recompute": _run(model, workload, kv_dtype, num_blocks=14, preemption_mode="recompute")}
    assert runs["swap"][1]["preemptions"]["swap"] > 0
    assert runs["recompute"][1]["preemptions"]["recompute"] > 0
    assert all(stats["prefix_cache_hits"] > 0 for _, stats in runs.values())
    change = 0.0
    for outputs, _ in runs.values():
        for a, b in zip(want, outputs):
            for pa, pb in zip((a.prompt_logprobs or [])[1:], (b.prompt_logprobs or [])[1:]):
                change = max(change, *(abs(pa[t] - pb[t]) for t in pa.keys() & pb.keys()))
    assert change <= MAX_LOGPROB_CHANGE[kv_dtype], f"prompt logprobs moved by {change:.3g}"
    ties = []
    for name, (outputs, _) in runs.items():
        for i, (a, b) in enumerate(zip(want, outputs)):
            ours, ref = b.outputs[0].token_ids, a.outputs[0].token_ids
            assert len(ours) == len(ref)
            step = next((j for j, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
            if step is None:
                continue
            top2 = sorted(a.outputs[0].logprobs[step].values())[-2:]
            gap = top2[1] - top2[0]
            assert gap <= 2 * change, (f"{name} request {i}: greedy divergence at step {step} where the float "
                                       f"cache's top-two gap is {gap:.3g} > {2 * change:.3g}")
            ties.append(f"{name} request {i} step {step}: gap {gap:.2e}")
    if ties:
        print(f"{kv_dtype}: accepted near-ties:", *ties, sep="\n  ")


def test_no_compilation_after_warmup_with_an_int8_cache(model):
    """After warmup(), requests over a shared prefix (cache hits) in a cache small enough to swap: no XLA
    compilation."""
    engine = LLMEngine(model, EngineConfig(block_size=8, max_num_seqs=8, max_num_batched_tokens=128, num_blocks=20,
                                           chunk_size=64, max_model_len=128, kv_dtype="int8",
                                           preemption_mode="swap"))
    engine.warmup(sampling=False)
    with compile_guard():
        for prompt, max_tokens in _workload(11, n=16):
            engine.add_request(None, prompt, _params(max_tokens))
        while engine.has_unfinished():
            engine.step()
    stats = engine.scheduler.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["preemptions"]["swap"] > 0, stats
