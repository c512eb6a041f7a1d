"""Async scheduling (EngineConfig.async_scheduling): the next decode step is planned and dispatched before the
last one's tokens are fetched, its input tokens fed on the device. The tokens must be exactly the synchronous
engine's, with no new compilation, no leaked block, and the scheduler's invariants after every step."""

import numpy as np
import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.packing import DecodeRows, SeqSlice, StepLayout, pack
from engine.request import Request
from engine.runner import CompileCounter
from engine.sampling_params import SamplingParams
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
    land = engine._land
    engine.stale_lands = 0

    def counting_land(plan, flight):  # lands whose batch holds a request that ended after it was planned
        engine.stale_lands += any(r.is_finished for r in plan.decodes)
        return land(plan, flight)

    monkeypatch.setattr(engine, "_land", counting_land)
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
    assert engine.stale_lands > 0
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


def test_decode_rows_feed_a_dispatched_step_and_learn_its_tokens():
    """DecodeRows across dispatch and land: the next pack feeds each row its own output of the last call
    (token_source = its index there) one position on, and after the land its tokens come from the host again;
    apart from token ids and token_source, every buffer equals a from-scratch pack."""
    bs, rows = 4, DecodeRows(4, 8, 4, 32)
    requests = [Request(f"q{i}", prompt_token_ids=list(range(5 + i)), max_tokens=20) for i in range(3)]
    for i, r in enumerate(requests):
        r.block_ids, r.num_computed_tokens = [1 + 8 * i + j for j in range(8)], r.num_tokens - 1
    layout = StepLayout(4, 4, 8, 4, decode=True)

    def check(buf, tokens, sources):
        names = [name for name, _ in layout.sizes()]
        fields = dict(zip(names, np.split(buf, np.cumsum([n for _, n in layout.sizes()])[:-1])))
        ref = dict(zip(names, np.split(pack([SeqSlice([r.last_token_id], r.num_tokens - 1, r.block_ids)
                                              for r in requests], layout, bs),
                                       np.cumsum([n for _, n in layout.sizes()])[:-1])))
        for name in names:
            if name not in ("token_ids", "token_source"):
                np.testing.assert_array_equal(fields[name], ref[name], err_msg=name)
        assert fields["token_source"].tolist() == sources
        known = [i for i, s in enumerate(sources[:len(requests)]) if s < 0]
        assert [fields["token_ids"][i] for i in known] == [tokens[i] for i in known]

    def advance(tokens):  # the next plan's view of the requests: one token further
        for r, token in zip(requests, tokens):
            r.output_token_ids.append(token)
            r.num_tokens += 1
            r.num_computed_tokens += 1

    check(rows.pack(requests, layout), [r.last_token_id for r in requests], [-1, -1, -1, -1])
    first = rows.packed_rows(), rows.dispatched()
    advance([-1] * 3)  # not known on the host yet
    check(rows.pack(requests, layout), None, [0, 1, 2, -1])
    second = rows.packed_rows(), rows.dispatched()
    rows.landed(*first, np.array([11, 12, 13]))  # every row was dispatched again since: nothing changes
    advance([-1] * 3)
    check(rows.pack(requests, layout), None, [0, 1, 2, -1])
    rows.sync(requests[:2])  # q2 leaves the batch (its row is released)
    rows.landed(*second, np.array([21, 22, 23]))
    for r, token in zip(requests, (11, 12, 13)):
        r.output_token_ids[-2] = token
    for r, token in zip(requests, (21, 22, 23)):
        r.output_token_ids[-1] = token
    requests = requests[:2]
    check(rows.pack(requests, layout), [21, 22], [-1, -1, -1, -1])
