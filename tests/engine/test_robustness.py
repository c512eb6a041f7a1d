"""No request can take the engine down (offline API): inputs the step cannot take are rejected at the door
naming the field, limits that used to fail inside the step are gone, a request whose step fails ends alone
with finish_reason "error", and hypothesis-generated SamplingParams never break the engine for others."""

import collections
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import EngineDeadError
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker import model_runner as runner_module
from engine.worker.model_runner import ModelRunner
from helpers.hf_models import make_hf_model
from models.loading import load_model

VOCAB = 384  # hf_models' vocabulary; EOS is 2
# A small cache (15 usable blocks of 8 tokens for up to 4 sequences of 64) so preemption happens too.
CONFIG = dict(block_size=8, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    make_hf_model("llama3", out, seed=seed)
    return LLM(load_model(str(out)), EngineConfig(**CONFIG))


@pytest.fixture(scope="module")
def baseline(llm):
    return llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def prompts():
    rng = np.random.default_rng()
    return [rng.integers(3, VOCAB, size=int(n)).tolist() for n in rng.integers(3, 30, size=6)]


def _texts(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _assert_idle(llm):
    engine = llm.engine
    assert engine.num_requests == 0
    assert engine.step() == []  # reaps what the last step finished (blocks are freed at the next reap)
    assert not engine.has_unfinished()
    assert engine.scheduler.block_pool.num_used == 0 and engine.scheduler.host_pool.num_used == 0
    assert not engine.runner.kv.swapped
    engine.scheduler.check_invariants()


# ---------------------------------------------------------------------- limits that used to fail in the step


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_with_many_stop_ids(llm, prompts, temperature):
    """EOS + 40 stop ids under min_tokens (the sampler's banned list was 16 wide and raised inside the step,
    leaving the batch queued so every later generate raised too): now a bitmask of any width."""
    baseline = _texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    stop_ids = list(range(3, 43))
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=12, min_tokens=6, stop_token_ids=stop_ids)
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = out.outputs[0].token_ids
        assert not set(tokens[:6]) & set(stop_ids + [2]), tokens
        assert out.outputs[0].finish_reason in ("stop", "length")
    assert _texts(llm.generate(prompts, GREEDY, use_tqdm=False)) == baseline
    _assert_idle(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=2**31), "top_k"),
    (dict(stop_token_ids=[2**31], min_tokens=2), "stop_token_ids"),
    (dict(min_tokens=2**31, max_tokens=None), "min_tokens"),
    (dict(max_tokens=2**40), "max_tokens"),
    (dict(n=2**31), "n"),
    (dict(priority=-(2**31) - 1), "priority"),
    (dict(n=True), "n"), (dict(top_k=True), "top_k"), (dict(temperature="0.5"), "temperature"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(stop=["\ud800"]), "stop"),
    (dict(stop_token_ids=list(range(257))), "stop_token_ids"),
])
def test_out_of_range_params_rejected_naming_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_bad_requests_rejected_at_add_and_change_nothing(llm, prompts):
    engine = llm.engine
    cases = [("stop_token_ids", [prompts[0], SamplingParams(stop_token_ids=[VOCAB], min_tokens=1)]),
             ("prompt", ["abc\ud800", GREEDY]),
             ("prompt", [[VOCAB + 5], GREEDY])]
    for field, (prompt, params) in cases:
        with pytest.raises((SamplingParamsError, ValueError)) as e:
            engine.add_request(None, prompt, params)
        assert getattr(e.value, "field", field) == field
        _assert_idle(llm)
    # A batch with one bad prompt is all or nothing, and the LLM stays usable.
    with pytest.raises(SamplingParamsError):
        llm.generate(prompts + [[VOCAB]], GREEDY, use_tqdm=False)
    _assert_idle(llm)
    assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == len(prompts)


def test_top_p_underflow_keeps_the_top_token(llm, prompts):
    """top_p=1e-300 is 0 in float32; the nucleus still holds the top token, so every seed gives greedy."""
    greedy = _texts(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
    for seed in range(3):
        params = SamplingParams(temperature=1.0, top_p=1e-300, seed=seed, max_tokens=12, ignore_eos=True)
        assert _texts(llm.generate(prompts[:2], params, use_tqdm=False)) == greedy


def test_top_k_beyond_vocabulary_is_no_filter(llm, prompts):
    """top_k larger than the vocabulary (but within int32) keeps every token: same draws as top_k off."""
    params = dict(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    off = _texts(llm.generate(prompts[:2], SamplingParams(**params), use_tqdm=False))
    assert _texts(llm.generate(prompts[:2], SamplingParams(top_k=2**31 - 1, **params), use_tqdm=False)) == off


# ---------------------------------------------------------------------- fault isolation


def _poison(monkeypatch, bad_ids: set[str], after_tokens: int = 0):
    """Make the runner fail whenever it starts a step with a row of a request in `bad_ids` with at least
    `after_tokens` output tokens (a host-side fault inside the step, synchronous or dispatched ahead)."""
    original = runner_module.ModelRunner._dispatch  # every jitted call, with every row's request

    def dispatch(self, buf, layout, rows, *args, **kwargs):
        rows = list(rows)
        for state, _ in rows:  # the worker's own copies of the requests
            if state.req_id.rpartition("#")[0] in bad_ids and len(state.output_token_ids) >= after_tokens:
                raise RuntimeError(f"injected fault for {state.req_id}")
        return original(self, buf, layout, rows, *args, **kwargs)

    monkeypatch.setattr(runner_module.ModelRunner, "_dispatch", dispatch)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("after_tokens", [0, 5])
def test_a_failing_request_ends_alone(llm, prompts, monkeypatch, after_tokens, async_scheduling):
    """Poisoned requests (in prefill, or mid-decode) end with finish_reason "error" and an error message;
    every other request in the same steps gives exactly its clean output; nothing leaks; later calls work.
    Under async scheduling a fault in a step planned ahead waits for the step in flight, then runs
    synchronously, isolated like any other."""
    clean = _texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    engine = llm.engine
    ids = [engine.add_request(None, p, GREEDY) for p in prompts]
    bad = {ids[1], ids[4]}
    _poison(monkeypatch, bad, after_tokens)
    monkeypatch.setattr(engine.config, "async_scheduling", async_scheduling)
    planned_ahead = engine.step_times["planned_ahead"]
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = delta
        engine.check_invariants()
    assert (engine.step_times["planned_ahead"] > planned_ahead) == async_scheduling
    monkeypatch.undo()
    for i, rid in enumerate(ids):
        if rid in bad:
            assert finals[rid].outputs[0].finish_reason == "error" and "injected fault" in finals[rid].error
        else:
            assert finals[rid].error is None
    _assert_idle(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _texts(outputs) == clean


def test_a_fault_in_a_step_planned_ahead_ends_its_request_alone(llm, prompts, monkeypatch):
    """Async scheduling: a request that makes the step planned ahead fail on the host (its dispatch) ends
    alone with "error": the step in flight lands, the plan runs synchronously a call later and fault
    isolation finds the request; the others give their clean tokens, the invariants hold at every step."""
    clean = _texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    engine = llm.engine
    monkeypatch.setattr(engine.config, "async_scheduling", True)
    ids = [engine.add_request(None, p, GREEDY) for p in prompts]
    render = {rid: engine.full_output(rid) for rid in ids}
    finals = {}

    def step():
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = render[delta.request_id]()
        engine.check_invariants()

    deferred = engine.step_times["deferred"]
    def in_flight():
        return engine._batch_queue and engine._batch_queue[0][1].in_flight

    while not (in_flight() and engine.scheduler.can_schedule_ahead()):  # a step in flight
        step()
    bad = engine._batch_queue[0][0].decodes[0].rpartition("#")[0]  # in the step scheduled ahead next
    _poison(monkeypatch, {bad})
    while engine.has_unfinished():
        step()
    assert engine.step_times["deferred"] > deferred  # the plan made ahead waited (at least once)
    monkeypatch.undo()
    for rid, want in zip(ids, clean):
        if rid == bad:
            assert finals[rid].outputs[0].finish_reason == "error" and "injected fault" in finals[rid].error
        else:
            assert finals[rid].error is None and finals[rid].outputs[0].token_ids == want
    _assert_idle(llm)


def test_failed_requests_through_generate(llm, prompts, monkeypatch):
    """LLM.generate returns every output: the failed one marked, the rest exact, and the LLM stays usable."""
    clean = _texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    _poison(monkeypatch, {f"req-{llm.engine._next_id + 2}"})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert outputs[2].outputs[0].finish_reason == "error" and outputs[2].error
    assert [t for i, t in enumerate(_texts(outputs)) if i != 2] == [t for i, t in enumerate(clean) if i != 2]
    _assert_idle(llm)
    assert _texts(llm.generate(prompts, GREEDY, use_tqdm=False)) == clean


def test_detokenizer_fault_ends_its_request_only(tmp_path_factory, monkeypatch):
    """A fault in one request's text processing (on the output side) ends that request alone."""
    from engine import output_processor as engine_module
    from helpers.hf_models import make_text_model

    llm = LLM(make_text_model(tmp_path_factory, seed=1)[0], EngineConfig(**CONFIG))
    prompts = ["hello world", "the quick brown fox", "ferry jax"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    original = engine_module.IncrementalDetokenizer.add_token
    poisoned_prompt = llm.tokenizer.encode(prompts[1])
    calls = collections.Counter()

    def add_token(self, token_id):
        if list(self.prompt_token_ids) == poisoned_prompt:
            calls[id(self)] += 1
            if calls[id(self)] > 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, token_id)

    monkeypatch.setattr(engine_module.IncrementalDetokenizer, "add_token", add_token)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert outputs[1].outputs[0].finish_reason == "error" and "injected" in outputs[1].error
    assert [outputs[0].outputs[0].text, outputs[2].outputs[0].text] == [clean[0], clean[2]]
    _assert_idle(llm)


def test_lost_device_state_is_fatal(llm, prompts, monkeypatch):
    """A fault after the donated cache was consumed cannot be isolated: EngineDeadError, not silent garbage."""
    engine = LLM(llm.engine.model, EngineConfig(**CONFIG)).engine  # its own: this one's cache is destroyed

    def run(self, prefills, decodes, masks):
        for leaf in __import__("jax").tree.leaves(self.kv.pages):
            leaf.delete()
        raise RuntimeError("injected device fault")

    engine.add_request(None, prompts[0], GREEDY)
    monkeypatch.setattr(ModelRunner, "_run", run)
    with pytest.raises(EngineDeadError, match="device state lost"):
        engine.step()


# ---------------------------------------------------------------------- hypothesis: any SamplingParams


_INTS = st.one_of(st.integers(-3, 40), st.integers(-(2**64), 2**64), st.booleans(), st.none(),
                  st.text(max_size=3), st.floats(allow_nan=True))
_FLOATS = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 3),
                    st.booleans(), st.none(), st.just(1e-300), st.text(max_size=3))
_FIELDS = {
    "n": _INTS, "temperature": _FLOATS, "top_p": _FLOATS, "top_k": _INTS, "min_p": _FLOATS, "seed": _INTS,
    "presence_penalty": _FLOATS, "frequency_penalty": _FLOATS, "repetition_penalty": _FLOATS,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.lists(_INTS, max_size=40), "ignore_eos": st.one_of(st.booleans(), _INTS),
    "max_tokens": _INTS, "min_tokens": _INTS, "logprobs": _INTS, "prompt_logprobs": _INTS, "priority": _INTS,
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.fixed_dictionaries({}, optional=_FIELDS), prompt_len=st.integers(1, 40))
def test_any_sampling_params_never_break_the_engine(llm, baseline, kwargs, prompt_len):
    """Property: every SamplingParams either is rejected naming one of its fields, or is accepted (or
    rejected at add, naming a field) and runs to completion without an error; afterwards the engine gives
    the same greedy baseline and holds no blocks."""
    kwargs = {k: v for k, v in kwargs.items() if not (k == "n" and isinstance(v, int) and v > 4)}
    if isinstance(kwargs.get("max_tokens"), int) and not isinstance(kwargs["max_tokens"], bool):
        kwargs["max_tokens"] = min(kwargs["max_tokens"], 24)  # keep each example short
    prompt = list(range(3, 3 + prompt_len))
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as e:
        assert e.field in SAMPLING_FIELDS, e.field
        return
    try:
        outputs = llm.generate([prompt], params, use_tqdm=False)
    except SamplingParamsError as e:
        assert e.field in SAMPLING_FIELDS | {"prompt"}, e.field
    else:
        for choice in outputs[0].outputs:
            assert choice.finish_reason in ("stop", "length"), (choice.finish_reason, outputs[0].error)
            assert all(0 <= t < VOCAB for t in choice.token_ids)
            for entry in choice.logprobs or []:
                assert all(math.isfinite(v) or v == -math.inf for v in entry.values())
    _assert_idle(llm)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline
