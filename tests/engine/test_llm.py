"""The user-facing engine: LLM.generate against transformers, seeds, logprobs, n > 1, stop strings, bad input."""


import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, SamplingParamsError
from helpers.hf_models import ARCHS, check_greedy_match, hf_greedy, hf_logits, make_hf_model, make_text_model
from models.loading import load_model

CONFIG = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=128)


def _fresh_seed():
    return int(np.random.SeedSequence().entropy % 2**31)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_generate_matches_transformers(arch, tmp_path):
    seed = _fresh_seed()
    torch_model = make_hf_model(arch, tmp_path, seed=seed)
    llm = LLM(str(tmp_path), EngineConfig(**CONFIG))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (3, 11, 29, 50)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref, ref_logits = hf_greedy(torch_model, prompt, 24)
        tie = check_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        if tie:
            print(f"{arch} (seed {seed}): accepted {tie}")
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_unrolled_layers_match_transformers_and_the_scan(arch, tmp_path):
    """EngineConfig(scan_layers=False): one module per layer, unrolled; the same greedy tokens as the scanned
    layers and as transformers (ties excepted), and one parameter array per layer."""
    seed = _fresh_seed()
    torch_model = make_hf_model(arch, tmp_path, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (5, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    unrolled = LLM(str(tmp_path), EngineConfig(**CONFIG, scan_layers=False))
    scanned = LLM(str(tmp_path), EngineConfig(**CONFIG))
    layers = unrolled.engine.model.params()["layers"]
    assert sorted(layers) == [0, 1] and layers[1]["mlp"]["gate_up_proj"]["kernel"].shape == (64, 256)
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (unrolled, scanned)]
    for prompt, a, b in zip(prompts, *outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ref, ref_logits = hf_greedy(torch_model, prompt, 16)
        tie = check_greedy_match(a.outputs[0].token_ids, ref, ref_logits)
        if tie:
            print(f"{arch} (seed {seed}): accepted {tie}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    seed = _fresh_seed()
    return seed, make_hf_model("llama3", out, seed=seed), load_model(str(out))


def test_seeded_request_same_alone_and_in_busy_batch_with_preemption(llama):
    seed, _, loaded = llama
    rng = np.random.default_rng(seed)
    target = rng.integers(3, 384, size=20).tolist()
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=30, ignore_eos=True)
    alone = LLM(loaded, EngineConfig(**CONFIG)).generate([target], params, use_tqdm=False)[0]
    busy = LLM(loaded, EngineConfig(**{**CONFIG, "num_blocks": 14}))
    others = [rng.integers(3, 384, size=int(rng.integers(5, 40))).tolist() for _ in range(8)]
    other_params = [SamplingParams(temperature=1.0, max_tokens=int(rng.integers(10, 40)), ignore_eos=True)
                    for _ in others]
    outputs = busy.generate(others[:4] + [target] + others[4:], other_params[:4] + [params] + other_params[4:],
                            use_tqdm=False)
    assert busy.engine.scheduler.stats()["preemptions"]["swap"] > 0
    assert outputs[4].outputs[0].token_ids == alone.outputs[0].token_ids
    different_seed = LLM(loaded, EngineConfig(**CONFIG)).generate(
        [target], SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=30, ignore_eos=True),
        use_tqdm=False)[0]
    assert different_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_logprobs_match_reference_log_softmax(llama):
    seed, torch_model, loaded = llama
    prompt = np.random.default_rng(seed).integers(3, 384, size=15).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    llm = LLM(loaded, EngineConfig(**CONFIG))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    # Again, its prompt blocks now cached: a request scoring its prompt must still run (and score) all of it.
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.prompt_logprobs == out.prompt_logprobs and again.outputs[0].token_ids == out.outputs[0].token_ids
    tokens = out.outputs[0].token_ids
    ref = torch.log_softmax(torch.tensor(hf_logits(torch_model, prompt + tokens)), dim=-1).numpy()
    for i, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token] - row[token]) < 1e-4
        top = np.argsort(-row)[:5]
        assert set(top.tolist()) <= set(entry)
        for t in top:
            assert abs(entry[int(t)] - row[t]) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]] - ref[pos - 1][prompt[pos]]) < 1e-4


def test_n_samples_share_the_prompt_and_match_single_runs(llama):
    """n=3 with seed s gives samples seeded s, s+1, s+2: each equals that seed run alone, though samples
    1 and 2 shared sample 0's full prompt blocks (prefix-cache hits)."""
    seed, _, loaded = llama
    prompt = np.random.default_rng(seed).integers(3, 384, size=37).tolist()
    base = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    llm = LLM(loaded, EngineConfig(**CONFIG))
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(n=3, seed=7, **base))
    shared = 0
    while engine.has_unfinished():
        engine.step()
        pool = engine.scheduler.kv.device_pool
        refs = [pool.ref_count(b) for b in range(1, pool.num_total + 1)]
        shared = max(shared, max(refs))
    assert shared == 3, "the three samples should hold the same full prompt blocks"
    singles = [llm.generate([prompt], SamplingParams(seed=7 + i, **base), use_tqdm=False)[0].outputs[0].token_ids
               for i in range(3)]
    together = llm.generate([prompt], SamplingParams(n=3, seed=7, **base), use_tqdm=False)[0]
    assert [o.index for o in together.outputs] == [0, 1, 2]
    assert [o.token_ids for o in together.outputs] == singles


@pytest.mark.parametrize("recompute", [False, True])
def test_prompt_logprobs_once_per_request_for_any_n(llama, recompute):
    """n samples of a request scoring its prompt: the prompt is scored once (by sample 0; the others share
    its cached blocks), one entry per prompt token, the same as with n=1 and as transformers' log-softmax.
    Under recompute preemption in a tight cache (16-token chunks: preempted mid-prefill too) the same."""
    seed, torch_model, loaded = llama
    prompt = np.random.default_rng(seed + 5).integers(3, 384, size=45).tolist()
    config = (dict(CONFIG, num_blocks=14, preemption_mode="recompute", chunk_size=16, max_num_batched_tokens=32)
              if recompute else CONFIG)
    llm = LLM(loaded, EngineConfig(**config))
    params = lambda n: SamplingParams(n=n, temperature=0.8, seed=7, max_tokens=24, prompt_logprobs=2,  # noqa: E731
                                      ignore_eos=True)
    stats = llm.engine.scheduler.stats
    outs = [llm.generate([prompt] * (1 if n == 1 else 2), params(n), use_tqdm=False) for n in (1, 3)]
    if not recompute:  # sample 0s score their prompts uncached; the forked samples hit their cached blocks
        assert stats()["prefix_cache_hits"] >= 4 * (len(prompt) // CONFIG["block_size"]), stats()
    if recompute:
        assert llm.engine.scheduler.stats()["preemptions"]["recompute"] > 0
    ref = torch.log_softmax(torch.tensor(hf_logits(torch_model, prompt)), dim=-1).numpy()
    for out in [o for batch in outs for o in batch]:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert abs(entry[prompt[pos]] - ref[pos - 1][prompt[pos]]) < 1e-4, pos
            assert set(np.argsort(-ref[pos - 1])[:2].tolist()) <= set(entry), pos
    assert [len(o.outputs) for batch in outs for o in batch] == [1, 3, 3]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A random llama whose vocabulary is a byte-level BPE tokenizer's, with the tokenizer files beside it."""
    return make_text_model(tmp_path_factory, seed=_fresh_seed())[0]


def middle_stop_string(tok, prompt: str, full) -> tuple[str, list[str]] | None:
    """A 4-character stop string spanning a token boundary near the middle of `full`'s text, and the decoded
    prompt + first i output tokens for every i; None if the text has none. Not through a U+FFFD: a partial
    UTF-8 character decodes to one in the growing prefixes, so where it first "occurs" would be misjudged. The
    cut nearest the middle with such a window (of the three that straddle it, the centred one first)."""
    pieces = [tok.decode(tok.encode(prompt) + full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    middle = len(full.token_ids) // 2
    for cut in sorted(range(2, len(full.token_ids) - 1), key=lambda i: abs(i - middle)):
        boundary = len(pieces[cut]) - len(pieces[0])
        for start in (boundary - 2, boundary - 1, boundary - 3):
            stop = full.text[max(start, 0):start + 4]
            if len(stop) == 4 and "\ufffd" not in stop:
                return stop, pieces
    return None


def test_stop_strings_and_streamed_text(text_model):
    llm = LLM(text_model, EngineConfig(**CONFIG))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tok = llm.tokenizer
    # A random model may write only broken UTF-8 after a prompt: the first prompt whose text has a stop string.
    for prompt in ("hello world", "the quick brown fox", "ferry jax", "of a", "caf\u00e9 na\u00efve"):
        full = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        assert full.text == tok.decode(tok.encode(prompt) + full.token_ids)[len(tok.decode(tok.encode(prompt))):]
        if (found := middle_stop_string(tok, prompt, full)) is not None:
            break
    stop, pieces = found
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    # Before min_tokens a stop string does not count: the text runs past its first occurrence. Stop strings
    # are armed with the min_tokens-th token, so an occurrence counts if it starts in that token's text or
    # later (a whole character's: a prefix ending in a partial one is passed over).
    first_stop_token = next(i for i in range(len(pieces)) if stop in pieces[i][len(pieces[0]):])
    min_tokens = first_stop_token + 3
    while min_tokens < len(pieces) and pieces[min_tokens - 1].endswith("\ufffd"):
        min_tokens += 1
    late = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                 min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= min_tokens
    counted = full.text.find(stop, len(pieces[min_tokens - 1]) - len(pieces[0]))
    if counted >= 0:
        assert (late.finish_reason, late.text) == ("stop", full.text[:counted])
    else:
        assert (late.finish_reason, late.text) == ("length", full.text)
    assert len(late.text) >= full.text.index(stop) + len(stop)
    # Streamed deltas concatenate to the final text.
    engine = llm.engine
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                          stop=[stop]))
    streamed = ""
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == rid
            streamed += delta.outputs[0].text
    assert streamed == out.text
    # A final-only request (as LLM.generate adds them): no delta until it finishes, then one with every
    # sample's whole output.
    engine.add_request("final", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                       stop=[stop], n=2), final_only=True)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [d.request_id for d in deltas] == ["final"] and deltas[0].finished
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in deltas[0].outputs] == [
        (i, out.text, out.token_ids, "stop") for i in range(2)]


@pytest.mark.parametrize("lag", [1, 2])
def test_outputs_steps_behind_the_core_change_nothing(text_model, lag):
    """The server folds a step's outputs on its own thread, up to two steps behind the core (engine_loop.py).
    Then a stop string ends its request in the core a step or two late, and the user sees exactly what the
    synchronous path gives: text, token ids, finish and stop reasons, streamed deltas; nothing leaks."""
    llm = LLM(text_model, EngineConfig(**CONFIG))
    prompts = ["hello world", "the quick brown fox", "ferry jax", "of a"]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    fulls = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    stops = [middle_stop_string(llm.tokenizer, p, f) if i % 2 == 0 else None
             for i, (p, f) in enumerate(zip(prompts, fulls))]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[s[0]] if s else [])
              for s in stops]
    expected = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    ids = [engine.add_request(None, p, q) for p, q in zip(prompts, params)]
    render = {rid: engine.full_output(rid) for rid in ids}
    core_requests = {rid: engine._groups[rid].requests[0] for rid in ids}
    pending, streamed, finals = [], dict.fromkeys(ids, ""), {}
    while engine.has_unfinished() or pending:
        if engine.has_unfinished():
            pending.append(engine.step_core())
        if len(pending) > lag or not engine.has_unfinished():
            for delta in engine.process_outputs(pending.pop(0)):
                streamed[delta.request_id] += delta.outputs[0].text
                if delta.finished:
                    finals[delta.request_id] = render[delta.request_id]()
    for rid, want in zip(ids, expected):
        got, want = finals[rid].outputs[0], want.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason)
        assert streamed[rid] == got.text
        # The core ran on for at most `lag` steps after the stop, plus the step that reads the finish.
        assert len(want.token_ids) <= len(core_requests[rid].output_token_ids) <= len(want.token_ids) + lag + 1
    assert sum(o.outputs[0].finish_reason == "stop" for o in expected) == sum(s is not None for s in stops)
    assert not engine.outputs.groups and engine.scheduler.kv.device_pool.num_used == 0
    engine.scheduler.check_invariants()


def test_bad_input_fails_at_submission_naming_the_field(llama):
    _, _, loaded = llama
    engine = LLMEngine(loaded, EngineConfig(**CONFIG, max_model_len=64))
    with pytest.raises(SamplingParamsError, match="top_p") as e:
        SamplingParams(top_p=0.0)
    assert e.value.field == "top_p"
    with pytest.raises(SamplingParamsError, match="max_model_len") as e:
        engine.add_request(None, list(range(3, 70)), SamplingParams())
    assert e.value.field == "prompt"
    with pytest.raises(SamplingParamsError, match="vocabulary"):
        engine.add_request(None, [5, 10_000], SamplingParams())
    with pytest.raises(SamplingParamsError, match="empty"):
        engine.add_request(None, [], SamplingParams())
    assert not engine.has_unfinished() and engine.scheduler.kv.device_pool.num_used == 0


def test_vllm_prompt_forms_and_refused_ones(text_model):
    """vLLM's TextPrompt / TokensPrompt dicts (with cache_salt) beside strings and token ids (numpy's too), in
    one batch; anything else is a TypeError naming the accepted forms, a bad dict field an error naming it, and
    a refused batch queues nothing."""
    llm = LLM(text_model, EngineConfig(**CONFIG))
    ids = llm.tokenizer.encode("hello world")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    forms = ["hello world", ids, np.array(ids), {"prompt": "hello world"}, {"prompt_token_ids": ids},
             {"prompt_token_ids": ids, "cache_salt": "tenant-a"}]
    outputs = llm.generate(forms, greedy, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt_token_ids for o in outputs] == [ids] * len(forms)
    assert llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        outputs[0].outputs[0].token_ids
    for bad, error, field in [
        ({"prompt": "hi", "multi_modal_data": {"image": None}}, SamplingParamsError, "multi_modal_data"),
        ({"prompt": 5}, SamplingParamsError, "prompt"),
        ({"prompt_token_ids": "hello"}, SamplingParamsError, "prompt_token_ids"),
        ({}, SamplingParamsError, "prompt"),
        ({"prompt": "hi", "prompt_token_ids": ids}, SamplingParamsError, "prompt"),
        ({"prompt": "hi", "lora_request": 1}, SamplingParamsError, "lora_request"),
        (42, TypeError, None),
        ([3.5, 2.0], TypeError, None),
        ([["hello"]], TypeError, None),
    ]:
        with pytest.raises(error) as e:
            llm.generate(["hello world", bad], greedy, use_tqdm=False)
        if field is not None:
            assert e.value.field == field, bad
        else:
            assert "TokensPrompt" in str(e.value)
        assert llm.engine.num_requests == 0  # (a decode step planned ahead may still be in flight: no request)


def test_the_stop_token_is_in_the_token_ids_not_the_text(text_model):
    """As vLLM: the EOS or stop token id that ends a sample is not in its text, even with special tokens kept
    (a tool call's text would end in the EOS token's), unless include_stop_str_in_output."""
    llm = LLM(text_model, EngineConfig(**CONFIG))
    tok = llm.tokenizer
    free = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop = free[3]
    cut = free[:free.index(stop) + 1]
    for include in (False, True):
        out = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                         stop_token_ids=[stop], skip_special_tokens=False,
                                                         include_stop_str_in_output=include), use_tqdm=False)[0]
        (sample,) = out.outputs
        assert sample.token_ids == cut and sample.finish_reason == "stop" and sample.stop_reason == stop
        assert sample.text == tok.decode(cut if include else cut[:-1], skip_special_tokens=False)


def test_min_tokens_bans_stop_tokens_until_reached(llama):
    """A stop token id is never sampled before min_tokens; without min_tokens it stops at once."""
    seed, _, loaded = llama
    llm = LLM(loaded, EngineConfig(**CONFIG))
    prompt = np.random.default_rng(seed).integers(3, 384, size=9).tolist()
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first], min_tokens=4),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_repetition_penalty_matches_transformers(llama):
    """Penalties reach the device sampler with each row's token history: greedy with a repetition
    penalty equals transformers' generate with its RepetitionPenaltyLogitsProcessor (same formula,
    over prompt and output tokens)."""
    seed, torch_model, loaded = llama
    llm = LLM(loaded, EngineConfig(**CONFIG))
    rng = np.random.default_rng(seed)
    # A small id range: many repeats. Several prompts, since on a given random model the penalty may leave
    # one greedy continuation unchanged (it only bites where the argmax is a repeated token).
    prompts = [rng.integers(3, 40, size=n).tolist() for n in (6, 19, 9, 13, 25, 31)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=20,
                                                   ignore_eos=True), use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    changed = 0
    for prompt, out, plain_out in zip(prompts, outputs, plain):
        with torch.no_grad():
            ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                       repetition_penalty=1.8, output_scores=True, return_dict_in_generate=True,
                                       pad_token_id=0)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        scores = torch.stack(ref.scores, dim=1)[0].float().numpy()
        tie = check_greedy_match(out.outputs[0].token_ids, ref_tokens, scores)
        if tie:
            print(f"seed {seed}: accepted {tie}")
        changed += plain_out.outputs[0].token_ids != out.outputs[0].token_ids
    assert changed, "the penalty should change some greedy continuation"


def test_cache_salt_and_reset_prefix_cache(llama):
    """Requests share cached prompt blocks only under equal salts; reset_prefix_cache is refused while a
    running request holds cached blocks and empties the cache once none does. Outputs never change."""
    seed, _, loaded = llama
    prompt = np.random.default_rng(seed).integers(3, 384, size=41).tolist()  # 5 full blocks of 8
    engine = LLMEngine(loaded, EngineConfig(**CONFIG))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}

    def run(rid, salt=None):
        engine.add_request(rid, prompt, params, cache_salt=salt)
        while engine.has_unfinished():
            for delta in engine.step():
                outputs.setdefault(rid, []).extend(delta.outputs[0].token_ids)
        return engine.scheduler.stats()["prefix_cache_hits"]

    assert run("a", salt="alice") == 0
    assert run("b") == 0                   # no salt: another namespace
    assert run("c", salt="bob") == 0
    assert run("d", salt="alice") == 40    # alice's 5 blocks
    assert run("e") == 80                  # and the unsalted ones
    engine.add_request("f", prompt, params)
    while not any(r.group_id == "f" for r in engine.scheduler.running):
        engine.step()                      # f holds cached blocks now (async: after e's last flight lands)
    assert engine.reset_prefix_cache() is False and engine.scheduler.stats()["prefix_cache_blocks"] > 0
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.schedule()            # reap f
    assert engine.reset_prefix_cache() is True and engine.scheduler.stats()["prefix_cache_blocks"] == 0
    hits = run("g")
    assert hits == 120                     # f hit 40; g found nothing after the reset
    assert len({tuple(t) for t in outputs.values()}) == 1
    with pytest.raises(SamplingParamsError, match="cache_salt must be a string") as error:
        engine.add_request("bad", prompt, params, cache_salt=7)
    assert error.value.field == "cache_salt" and not engine.has_unfinished()
