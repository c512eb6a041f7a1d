"""Quantized weights through the engine: --quantization on load (on the CPU the packed native matmul reads the
int8/int4 panels), against transformers on the same weights dequantized, under preemption; zero compilations
after warm-up; the engine's weight accounting; bad settings refused."""

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.compilation import compile_guard
from helpers.hf_models import check_greedy_match, hf_greedy, load_weights_into, make_hf_model
from models.loading import load_model, quantize_model

CONFIG = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(seed, directory, torch model) of a random Qwen2 (tied head, q/k/v biases)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    path = tmp_path_factory.mktemp("qwen2")
    return seed, str(path), make_hf_model("qwen2", path, seed=seed)


@pytest.mark.parametrize("method,group", [("int8", 128), ("int4", 32), ("fp8", 128)])
def test_quantized_engine_matches_transformers_under_preemption(checkpoint, method, group):
    """Three prompts in a cache too small for all of them (swap preemption): every sequence's greedy tokens are
    transformers' on the weights quantized as the engine quantizes them, dequantized."""
    seed, path, torch_model = checkpoint
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (3, 17, 30)]
    llm = LLM(path, EngineConfig(**CONFIG, quantization=method, quantization_group_size=group, num_blocks=9))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.stats()["preemptions"]["swap"] > 0
    load_weights_into(torch_model, quantize_model(load_model(path), method, group))
    for prompt, out in zip(prompts, outs):
        tie = check_greedy_match(out.outputs[0].token_ids, *hf_greedy(torch_model, prompt, MAX_TOKENS))
        if tie:
            print(f"{method} (seed {seed}): accepted {tie}")
    float_llm = LLM(path, EngineConfig(**CONFIG, num_blocks=9))
    ratio = llm.engine.memory["weight_bytes"] / float_llm.engine.memory["weight_bytes"]
    assert ratio < 0.6, ratio  # the float32 norms and biases stay; the linears and the tied head shrink


def test_quantized_engine_compiles_nothing_after_warm_up(checkpoint):
    _, path, _ = checkpoint
    llm = LLM(path, EngineConfig(**CONFIG, quantization="int4", quantization_group_size=32, warmup="full"))
    rng = np.random.default_rng(0)
    with compile_guard():
        llm.generate([rng.integers(3, 384, size=n).tolist() for n in (1, 9, 40, 63)],
                     SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)


def test_bad_quantization_settings_are_refused(checkpoint):
    _, path, _ = checkpoint
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="quantized already"):
        LLM(quantize_model(load_model(path), "int8"), EngineConfig(**CONFIG, quantization="int4"))
