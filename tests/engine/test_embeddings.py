"""Embeddings from a decoder model (PoolingParams, LLM.embed): equal to transformers' final hidden states pooled,
through chunked prefill, batches, generation alongside, preemption, and with task="embed" no compilation after
warm-up."""

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import EmbeddingRequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.compilation import compile_guard
from helpers.hf_models import random_llama_checkpoint, rel_err

VOCAB = 384
# Small blocks and a small token budget: a 50-token prompt prefills in several chunks.
CONFIG = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=32)
POOLINGS = [PoolingParams(pooling_type=t, normalize=n) for t in ("last", "mean") for n in (True, False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_llama_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[2], EngineConfig(**CONFIG))


def hf_embedding(torch_model, prompt: list[int], params: PoolingParams) -> np.ndarray:
    """transformers' final hidden states (after the final norm), pooled as `params` says, in float64."""
    with torch.no_grad():
        hidden = torch_model.model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    pooled = hidden.mean(axis=0) if params.pooling_type == "mean" else hidden[-1]
    return pooled / np.linalg.norm(pooled) if params.normalize else pooled


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]


def _check(outputs, prompts, torch_model, params):
    assert len(outputs) == len(prompts)
    for out, prompt in zip(outputs, prompts):
        assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.error is None
        assert out.prompt_token_ids == prompt
        got = np.asarray(out.outputs.embedding)
        assert got.shape == (64,)
        err = rel_err(got, hf_embedding(torch_model, prompt, params))
        assert err < 1e-4, f"{params}: relative error {err:.2e} for a prompt of {len(prompt)} tokens"


def _assert_all_freed(engine: LLMEngine):
    """Finished requests leave at the next step's reap: then no request and no block is left."""
    for _ in range(2):
        if engine.has_unfinished():
            assert engine.step() == []
    assert not engine.has_unfinished()
    assert engine.scheduler.block_pool.num_used == 0
    engine.check_invariants()


@pytest.mark.parametrize("params", POOLINGS, ids=lambda p: f"{p.pooling_type}-{'norm' if p.normalize else 'raw'}")
def test_embeddings_match_transformers_in_one_batch_of_mixed_lengths(checkpoint, llm, params):
    """Lengths from 1 token to 50 (chunked: the token budget is 32) in one call: several sequences share each
    pooling call, and the long ones span several steps; every block is freed after."""
    seed, torch_model, _ = checkpoint
    prompts = _prompts(seed, (1, 3, 9, 17, 50, 5, 33))
    _check(llm.embed(prompts, params, use_tqdm=False), prompts, torch_model, params)
    _assert_all_freed(llm.engine)


def test_embed_takes_a_string_token_ids_and_defaults(checkpoint, llm):
    """One prompt of token ids is one output; the default is last-token pooling, normalized."""
    seed, torch_model, _ = checkpoint
    prompt = _prompts(seed + 1, (12,))[0]
    (out,) = llm.embed(prompt, use_tqdm=False)
    _check([out], [prompt], torch_model, PoolingParams())
    assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5


def test_chunked_prompt_with_a_chunk_size(checkpoint):
    """A prompt far longer than one chunk (chunk_size 8: seven chunks), mean pooled: the per-chunk sums add up
    on the host to transformers' mean."""
    seed, torch_model, loaded = checkpoint
    llm = LLM(loaded, EngineConfig(**CONFIG, chunk_size=8))
    prompts = _prompts(seed + 2, (53, 8, 16))
    params = PoolingParams(pooling_type="mean", normalize=False)
    _check(llm.embed(prompts, params, use_tqdm=False), prompts, torch_model, params)
    _assert_all_freed(llm.engine)


def test_embeddings_and_generation_in_one_engine(checkpoint, llm):
    """Embedding requests added among generation requests: the generated tokens equal a run without them, and
    the embeddings equal transformers'."""
    seed, torch_model, _ = checkpoint
    engine = llm.engine
    gen_prompts = _prompts(seed + 3, (7, 21, 40))
    emb_prompts = _prompts(seed + 4, (30, 4, 45))
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(gen_prompts, sampling, use_tqdm=False)]
    params = PoolingParams(pooling_type="mean")
    gen_ids = [engine.add_request(None, p, sampling, final_only=True) for p in gen_prompts[:2]]
    emb_ids = [engine.add_request(None, p, params) for p in emb_prompts[:2]]
    outputs = {}
    for step in range(1000):
        if step == 2:  # one of each arrives while the others decode and prefill
            gen_ids.append(engine.add_request(None, gen_prompts[2], sampling, final_only=True))
            emb_ids.append(engine.add_request(None, emb_prompts[2], params))
        elif step > 2 and not engine.has_unfinished():
            break
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        engine.check_invariants()
    assert [outputs[i].outputs[0].token_ids for i in gen_ids] == alone
    _check([outputs[i] for i in emb_ids], emb_prompts, torch_model, params)
    _assert_all_freed(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_preempted_embeddings_match_transformers(checkpoint, mode, pooling_type):
    """Long embedding requests mid-prefill (chunks of 8) when an urgent generation request that needs every
    block arrives: they are preempted (swapped out, or freed to compute again) and still equal transformers'."""
    seed, torch_model, loaded = checkpoint
    engine = LLMEngine(loaded, EngineConfig(**CONFIG, chunk_size=8, num_blocks=17, preemption_mode=mode))
    prompts = _prompts(seed + 5, (60, 44, 52))
    params = PoolingParams(pooling_type=pooling_type)
    ids = [engine.add_request(None, p, params) for p in prompts]
    outputs = {}
    for _ in range(2):
        outputs |= {o.request_id: o for o in engine.step()}
    kv = engine.scheduler.kv
    urgent = _prompts(seed + 6, (kv.num_total * kv.block_size - 1,))[0]
    engine.add_request("urgent", urgent, SamplingParams(temperature=0.0, max_tokens=1, priority=-1))
    while engine.has_unfinished():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        engine.check_invariants()
    assert engine.scheduler.stats()["preemptions"][mode] > 0
    assert outputs["urgent"].outputs[0].finish_reason == "length"
    _check([outputs[i] for i in ids], prompts, torch_model, params)
    _assert_all_freed(engine)


def test_last_pooling_shares_cached_prefixes_mean_pooling_computes_every_row(checkpoint, llm):
    """The same long prompt twice: last pooling's second request starts after the cached blocks (its last
    token still computed), mean pooling's computes every row; both equal transformers'."""
    seed, torch_model, _ = checkpoint
    engine = llm.engine
    prompt = _prompts(seed + 7, (41,))[0]
    for pooling_type, hits in (("last", True), ("mean", False)):
        params = PoolingParams(pooling_type=pooling_type)
        llm.embed([prompt], params, use_tqdm=False)
        before = engine.stats()["prefix_cache_hits"]
        _check(llm.embed([prompt], params, use_tqdm=False), [prompt], torch_model, params)
        assert (engine.stats()["prefix_cache_hits"] > before) == hits
    _assert_all_freed(engine)


def test_task_embed_compiles_nothing_after_warmup(checkpoint):
    """task="embed": warm-up compiles the pooling programs of every prefill bucket; then batches of every
    length, chunked and preempted, compile nothing. Generation is refused, naming the task."""
    seed, torch_model, loaded = checkpoint
    llm = LLM(loaded, EngineConfig(**CONFIG, num_blocks=17, warmup="full", task="embed"))
    with pytest.raises(ValueError, match="task is 'embed'"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    rng = np.random.default_rng(seed + 8)
    prompts = [rng.integers(3, VOCAB, size=int(rng.integers(1, 120))).tolist() for _ in range(24)]
    params = PoolingParams(pooling_type="mean")
    with compile_guard():
        outputs = llm.embed(prompts, params, use_tqdm=False)
        outputs += llm.embed(prompts[:3], PoolingParams(), use_tqdm=False)
    _check(outputs[:24], prompts, torch_model, params)
    _assert_all_freed(llm.engine)


def test_bad_pooling_params_and_prompts_name_the_field(llm):
    for kwargs, field in ((dict(pooling_type="cls"), "pooling_type"), (dict(normalize=1), "normalize"),
                          (dict(dimensions=32), "dimensions")):
        with pytest.raises(SamplingParamsError) as e:
            PoolingParams(**kwargs)
        assert e.value.field == field
    engine = llm.engine
    with pytest.raises(SamplingParamsError, match="empty"):
        engine.add_request(None, [], PoolingParams())
    for prompt in ([VOCAB], list(range(3, 3 + engine.max_model_len + 1))):  # outside the vocabulary, too long
        with pytest.raises(SamplingParamsError) as e:
            llm.embed([[5, 6], prompt], use_tqdm=False)
        assert e.value.field == "prompt"
    _assert_all_freed(engine)  # the first prompt of each batch was taken back
    assert len(llm.embed([list(range(3, 3 + engine.max_model_len))], use_tqdm=False)) == 1  # max_model_len fits
