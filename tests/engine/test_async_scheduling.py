"""Async scheduling (EngineConfig.async_scheduling): the next decode step is planned and dispatched before the
last one's tokens are fetched, its input tokens fed on the device. The tokens must be exactly the synchronous
engine's, with no new compilation, no leaked block, and the scheduler's invariants after every step."""

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.compilation import CompileCounter
from models.config import ModelConfig
from models.loading import random_model


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    return random_model(cfg, seed=int(np.random.SeedSequence().entropy % 2**31))


def _workload(seed: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampled requests (top-p, logprobs), stop ids that end some early, min_tokens and
    penalties (rows that need their last token on the host: those steps run synchronously), and n=2."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(14):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 30))).tolist()
        max_tokens = int(rng.integers(4, 40))
        params = [
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                           stop_token_ids=rng.choice(np.arange(3, vocab), size=vocab // 2, replace=False).tolist()),
            SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, ignore_eos=True, n=2),
        ][i % 4]
        if i == 4:  # aborted once it has 6 tokens
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        if i == 9:
            params = SamplingParams(temperature=0.7, seed=i, max_tokens=20, min_tokens=6, ignore_eos=True)
        if i == 13:
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)
        requests.append((prompt, params))
    return requests


def _run(model, workload, async_scheduling: bool, monkeypatch) -> tuple[dict, LLMEngine, int]:
    """Six requests at once, the rest one every fourth step; request 4 aborted once it has 6 tokens. Returns
    every (request, sample)'s tokens, the engine and the compilations after warm-up. Few buckets (decode 1, 2, 4;
    prefill 16): the full sampler's programs take seconds each to compile."""
    engine = LLMEngine(model, EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, num_blocks=48,
                                           max_model_len=96, async_scheduling=async_scheduling))
    engine.warmup(sampling=True)
    update = engine._update
    engine.stale_updates = 0

    def counting_update(scheduler_output, runner_output):  # a batch with a request that ended after it was scheduled
        plan = engine.scheduler.scheduled(scheduler_output.step)
        engine.stale_updates += any(r.is_finished for r in plan.decodes)
        return update(scheduler_output, runner_output)

    monkeypatch.setattr(engine, "_update", counting_update)
    counter = CompileCounter.install()
    before = counter.count
    tokens: dict[tuple[str, int], list[int]] = {}
    for i, (prompt, params) in enumerate(workload[:6]):
        engine.add_request(f"r{i}", prompt, params)
    next_request, step = 6, 0
    while engine.has_unfinished() or next_request < len(workload):
        if step % 4 == 0 and next_request < len(workload):
            engine.add_request(f"r{next_request}", *workload[next_request])
            next_request += 1
        for delta in engine.step():
            for out in delta.outputs:
                tokens.setdefault((delta.request_id, out.index), []).extend(out.token_ids)
        if len(tokens.get(("r4", 0), ())) >= 6 and engine.abort("r4"):
            tokens[("r4", 0)].append("aborted")
        engine.check_invariants()
        step += 1
    engine.scheduler.schedule()  # one more reap returns the last finished requests' blocks
    assert engine.scheduler.kv.device_pool.num_used == 0
    return tokens, engine, counter.count - before


def test_async_scheduling_gives_the_synchronous_tokens(model, monkeypatch):
    workload = _workload(int(np.random.SeedSequence().entropy % 2**31), model.cfg.vocab_size)
    sync, _, sync_compiles = _run(model, workload, False, monkeypatch)
    ahead, engine, ahead_compiles = _run(model, workload, True, monkeypatch)
    assert sync_compiles == 0 and ahead_compiles == 0
    assert sync.keys() == ahead.keys() and sync[("r4", 0)][-1] == "aborted"
    for key, expected in sync.items():
        assert ahead[key] == expected, f"{key}: {ahead[key]} with async scheduling, {expected} without"
    # Requests ended (a stop id, max_tokens, the abort) while the step after their last was in flight.
    assert engine.stale_updates > 0
    # Steps were planned ahead (not all: while requests wait, a step with a prefill or a host-bound row is not),
    # and every one started (none waited for a later call: no fault was injected)
    assert engine.step_times["planned_ahead"] > 0 and engine.step_times["deferred"] == 0, engine.step_times


def test_a_request_after_the_last_one_ended_starts_at_once(model):
    """When the last running request ends while the step after it is in flight, the plan made ahead of that
    step has nothing to decode: nothing is left for a later call, so the next request is admitted, prefilled
    and sampled in the very next call, as with synchronous steps (its first token came a call late)."""
    engine = LLMEngine(model, EngineConfig(block_size=8, max_num_seqs=4, num_blocks=32, max_model_len=64,
                                           async_scheduling=True))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, list(range(3, 20)), params)
        first_call_outputs = engine.step()
        assert [(d.request_id, len(d.outputs[0].token_ids)) for d in first_call_outputs] == [(rid, 1)]
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
    assert engine.step_times["planned_ahead"] > 0 and engine.step_times["deferred"] == 0
