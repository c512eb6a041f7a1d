"""The engine end to end on a real (small, random) checkpoint: scheduler + runner + jitted steps."""

import json
import shutil

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker import compilation
from engine.worker.compilation import CompileCounter
from helpers.hf_models import check_greedy_match, hf_greedy, make_hf_model, random_llama_checkpoint
from models.config import ModelConfig
from models.loading import load_model, random_model
from models.paged import kv_cache_groups


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_llama_checkpoint(tmp_path_factory)


def _workload(seed, vocab, n=10):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab, size=int(rng.integers(4, 40))).tolist(), int(rng.integers(16, 40)))
            for _ in range(n)]


def _greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(loaded, workload, **config):
    llm = LLM(loaded, EngineConfig(block_size=8, max_num_seqs=8, **config))
    outputs = llm.generate([p for p, _ in workload], [_greedy(m) for _, m in workload], use_tqdm=False)
    scheduler = llm.engine.scheduler
    scheduler.schedule()  # one more step's reap returns the last finished requests' blocks
    assert scheduler.kv.device_pool.num_used == 0
    return [o.outputs[0].token_ids for o in outputs], scheduler


def test_a_cold_lazy_start_runs_every_step_on_its_largest_programs(checkpoint):
    """warmup="lazy" with nothing compiled before compiles only each sampler's largest decode and prefill
    programs before it returns; until the thread has compiled the rest, steps pad up to a compiled program.
    With the thread stopped at once, greedy requests of mixed prompt lengths in decode batches of 6 down to 1
    compile nothing more and give transformers' tokens (ties excepted, reported); then sampled ones too."""
    seed, torch_model, loaded = checkpoint
    workload = _workload(seed + 3, loaded.cfg.vocab_size, n=6)
    counter = CompileCounter.install()
    llm = LLM(loaded, EngineConfig(block_size=8, max_num_seqs=8, num_blocks=256, max_num_batched_tokens=512,
                                   warmup="lazy"))
    llm.engine.runner.compilation.stop_background_warmup()  # after the compile in progress, if any
    assert llm.engine.runner.compilation.warmup_split[0] == 4
    before = counter.count
    outputs = llm.generate([p for p, _ in workload], [_greedy(m) for _, m in workload], use_tqdm=False)
    llm.generate([p for p, _ in workload[:3]], SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
    assert counter.count == before, f"{counter.count - before} compilations in the steps"
    ties = [tie for (prompt, max_tokens), out in zip(workload, outputs)
            if (tie := check_greedy_match(out.outputs[0].token_ids, *hf_greedy(torch_model, prompt, max_tokens)))]
    if ties:
        print(f"seed {seed}: accepted ties:", *ties, sep="\n  ")


def test_greedy_outputs_identical_under_preemption_and_chunking(checkpoint):
    """Ample cache, tiny cache (swap and recompute), chunk sizes 16, 64 and whole prompts: every run
    gives transformers' greedy tokens (ties excepted, reported)."""
    seed, torch_model, loaded = checkpoint
    workload = _workload(seed, loaded.cfg.vocab_size)
    runs = {
        "ample": _run(loaded, workload, num_blocks=256, max_num_batched_tokens=512),
        "swap": _run(loaded, workload, num_blocks=14, preemption_mode="swap", max_num_batched_tokens=512),
        "recompute": _run(loaded, workload, num_blocks=14, preemption_mode="recompute", max_num_batched_tokens=512),
        "chunk16": _run(loaded, workload, num_blocks=256, chunk_size=16, max_num_batched_tokens=64),
        "chunk64": _run(loaded, workload, num_blocks=256, chunk_size=64, max_num_batched_tokens=128),
    }
    assert runs["swap"][1].stats()["preemptions"]["swap"] > 0
    assert runs["recompute"][1].stats()["preemptions"]["recompute"] > 0
    ties = []
    for i, (prompt, max_tokens) in enumerate(workload):
        ref, ref_logits = hf_greedy(torch_model, prompt, max_tokens)
        for name, (outputs, _) in runs.items():
            tie = check_greedy_match(outputs[i], ref, ref_logits)
            if tie:
                ties.append(f"{name} request {i}: {tie}")
    if ties:
        print(f"seed {seed}: accepted ties:", *ties, sep="\n  ")


def test_a_step_that_prefills_and_decodes_makes_one_ragged_call(checkpoint):
    """Requests arriving while others decode, in 16-token chunks: each step that runs prefill chunks and
    decodes makes ONE device call (a prefill layout holding both, decodes first), and the tokens are
    transformers' greedy ones (ties excepted, reported); the requests asking logprobs get transformers'
    log-softmax of each token and its top two (each row read from its place in the call)."""
    seed, torch_model, loaded = checkpoint
    workload = _workload(seed + 7, loaded.cfg.vocab_size, n=8)
    engine = LLMEngine(loaded, EngineConfig(block_size=8, max_num_seqs=8, num_blocks=256, chunk_size=16,
                                            max_num_batched_tokens=32))
    runner, scheduler, calls, plans = engine.runner, engine.scheduler, [], []
    device_step, schedule = runner.device_step, scheduler.schedule
    runner.device_step = lambda buf, md, layout, *rest: calls.append(layout) or device_step(buf, md, layout, *rest)
    scheduler.schedule = lambda **kw: plans.append(schedule(**kw)) or plans[-1]
    ids, outputs, ragged, pending = {}, {}, 0, list(enumerate(workload))
    while pending or engine.has_unfinished():
        if pending and engine.stats()["step"] % 3 == 0:  # one request every third step: prefills meet decodes
            i, (prompt, max_tokens) = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    logprobs=2 if i % 2 else None)
            ids[engine.add_request(None, prompt, params)] = i
        calls.clear(), plans.clear()
        for delta in engine.step():
            tokens, logprobs = outputs.setdefault(ids[delta.request_id], ([], []))
            tokens += delta.outputs[0].token_ids
            logprobs += delta.outputs[0].logprobs or []
        mixed = [p for p in plans if p.prefills and p.decodes]
        if mixed:  # a step that prefills is synchronous: its plan runs in the call that made it
            ragged += 1
            assert len(calls) == 1 and not calls[0].decode, f"a ragged step's calls: {calls}"
            assert calls[0].num_seqs >= len(mixed[0].decodes) + len(mixed[0].prefills), calls[0]
    assert ragged >= 5, f"only {ragged} steps ran prefills and decodes together"
    ties = []
    for i, (prompt, max_tokens) in enumerate(workload):
        tokens, logprobs = outputs[i]
        ref, ref_logits = hf_greedy(torch_model, prompt, max_tokens)
        if tie := check_greedy_match(tokens, ref, ref_logits):
            ties.append(f"request {i}: {tie}")
        elif i % 2:
            assert len(logprobs) == max_tokens, f"request {i}: {len(logprobs)} logprobs entries"
            ref_logprobs = ref_logits - np.logaddexp.reduce(ref_logits, axis=-1, keepdims=True)
            for step, (token, entry, row) in enumerate(zip(ref, logprobs, ref_logprobs)):
                top = np.argsort(-row)[:2].tolist()
                assert set(top) | {token} == set(entry), f"request {i} step {step}: {entry} vs top {top}"
                for t in entry:
                    assert abs(entry[t] - row[t]) < 2e-4, f"request {i} step {step} token {t}"
    if ties:
        print(f"seed {seed}: accepted ties:", *ties, sep="\n  ")


def test_no_compilation_after_warmup(checkpoint):
    """200 requests of mixed prompt and output lengths after warmup(), half of them over a shared prefix
    (prefills starting after cache hits): zero new XLA compilations."""
    seed, _, loaded = checkpoint
    engine = LLMEngine(loaded, EngineConfig(block_size=8, max_num_seqs=16, max_num_batched_tokens=128,
                                            num_blocks=160, chunk_size=64, max_model_len=160))
    engine.warmup(sampling=False)
    counter = CompileCounter.install()
    before = counter.count
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, loaded.cfg.vocab_size, size=60).tolist()
    for i in range(200):
        prompt = rng.integers(3, loaded.cfg.vocab_size, size=int(rng.integers(1, 130))).tolist()
        if i % 2:
            prompt = (shared + prompt)[:130]
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True,
                                priority=int(rng.integers(0, 3)))
        engine.add_request(None, prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert counter.count - before == 0, f"{counter.count - before} compilations after warm-up"
    assert engine.scheduler.stats()["prefix_cache_hits"] > 0


def _shared_prefix_workload(seed, vocab, n=10, system_len=44):
    """Most prompts open with one long "system prompt"; two do not."""
    rng = np.random.default_rng(seed + 1)
    system = rng.integers(3, vocab, size=system_len).tolist()
    prompts = [(system if i < n - 2 else []) + rng.integers(3, vocab, size=int(rng.integers(3, 13))).tolist()
               for i in range(n)]
    return [(p, int(rng.integers(12, 30))) for p in prompts]


def _counting_window_frees(engine: LLMEngine) -> list[int]:
    """A one-item list counting the blocks the engine's KV cache manager frees behind windows from now on."""
    kv, freed = engine.scheduler.kv, [0]
    original = kv.free_behind_window

    def counting(request):
        free = kv.num_free
        original(request)
        freed[0] += kv.num_free - free

    kv.free_behind_window = counting
    return freed


def _urgent_request(engine: LLMEngine, seed: int) -> tuple[list[int], int]:
    """A prompt (and 1 token to generate) that needs every block of the engine's cache."""
    kv = engine.scheduler.kv
    length = kv.num_total // kv.num_groups * kv.block_size - 1
    return np.random.default_rng(seed).integers(3, engine.model.cfg.vocab_size, size=length).tolist(), 1


def _generate_with_a_late_urgent_request(engine: LLMEngine, workload, urgent) -> list[list[int]]:
    """The workload at priority 1, then, three steps in, `urgent` (_urgent_request) at priority 0, which preempts
    whatever runs: a preemption whatever the workload's lengths. Returns the outputs, the urgent one's last."""
    ids = [engine.add_request(None, p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, priority=1),
                              final_only=True) for p, m in workload]
    outputs = {}
    for _ in range(3):
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    ids.append(engine.add_request(None, urgent[0], _greedy(urgent[1]), final_only=True))
    while engine.has_unfinished():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    return [outputs[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize("mode", ["ample", "swap", "recompute"])
def test_prefix_caching_on_and_off_give_transformers_tokens(checkpoint, mode):
    """Shared-prefix prompts, then second turns that resend prompt + answer + a new message: greedy tokens
    with prefix caching on equal those with it off and transformers' (ties excepted, reported), with
    ample blocks and under forced swap / recompute preemption (a cache of what the longest request needs, and
    in each turn a late urgent request needing all of it). The cache must actually be hit."""
    seed, torch_model, loaded = checkpoint
    vocab = loaded.cfg.vocab_size
    first_turns = _shared_prefix_workload(seed, vocab)
    # Under preemption, just the blocks the longest request (a second turn: its first turn's prompt and answer,
    # 5 tokens, 8 new) needs alone, plus the null block.
    longest = max([len(p) + m for p, m in first_turns] + [len(p) + m + 5 + 8 for p, m in first_turns[:4]])
    tight = 1 + -(-longest // 8)
    config = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=512, preemption_mode="swap")
    config |= {"ample": dict(num_blocks=256), "swap": dict(num_blocks=tight),
               "recompute": dict(num_blocks=tight, preemption_mode="recompute")}[mode]
    rng = np.random.default_rng(seed + 2)
    runs, ties, urgent = {}, [], []
    for caching in (True, False):
        llm = LLM(loaded, EngineConfig(enable_prefix_caching=caching, **config))
        if mode == "ample":
            generate = lambda turns, llm=llm: [o.outputs[0].token_ids for o in llm.generate(  # noqa: E731
                [p for p, _ in turns], [_greedy(m) for _, m in turns], use_tqdm=False)]
        else:
            urgent = [_urgent_request(llm.engine, seed + turn) for turn in range(2)]
            generate = lambda turns, llm=llm: _generate_with_a_late_urgent_request(  # noqa: E731
                llm.engine, turns, urgent[0 if turns is first_turns else 1])
        first = generate(first_turns)
        if not runs:  # the second turns are built from the first run's answers (equal in both, asserted)
            second_turns = [(p + answer + rng.integers(3, vocab, size=5).tolist(), 8)
                            for (p, _), answer in zip(first_turns[:4], first)]
        second = generate(second_turns)
        if urgent:  # each turn's urgent request last: in the outputs' order
            first, second = first[:-1], second[:-1] + [first[-1], second[-1]]
        stats = llm.engine.scheduler.stats()
        assert (stats["prefix_cache_hits"] > 0) == caching
        if mode != "ample":
            assert stats["preemptions"][config["preemption_mode"]] > 0, (seed, caching, config, stats)
        runs[caching] = (first + second, stats)
    for i, (prompt, max_tokens) in enumerate(first_turns + second_turns + urgent):
        ref, ref_logits = hf_greedy(torch_model, prompt, max_tokens)
        reports = [check_greedy_match(runs[caching][0][i], ref, ref_logits) for caching in (True, False)]
        if any(reports):
            ties.append(f"{mode} request {i}: {reports}")
        else:
            assert runs[True][0][i] == runs[False][0][i] == ref
    if mode == "ample":  # nothing evicted: each second turn finds its whole history (>= 64 tokens) but
        # the last token's block. (The first turns, all admitted in step 1, find nothing published yet;
        # under preemption they are admitted over time and hit the system prompt.)
        assert runs[True][1]["prefix_cache_hits"] >= 4 * 56
    if ties:
        print(f"seed {seed}: accepted ties:", *ties, sep="\n  ")


def _random_engine(num_layers: int, **config) -> LLMEngine:
    cfg = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    return LLMEngine(random_model(cfg, seed=num_layers), EngineConfig(block_size=8, max_num_seqs=4,
                                                                      max_num_batched_tokens=32, num_blocks=24,
                                                                      **config))


def test_a_warm_start_loads_every_program_after_it_returns(tmp_path, monkeypatch):
    """With the persistent compilation cache on, each sampler's compiled programs leave a record; a later lazy
    start of the same engine finds the records and compiles nothing before it returns (the step programs and
    the swap copies load on the thread, and then nothing compiles, swaps included); any change to what the
    programs depend on (here: Ferry's source) misses the record, and the greedy programs compile first again."""
    monkeypatch.setattr(compilation, "warm_records_dir", lambda: tmp_path)
    config = dict(warmup="lazy", preemption_mode="swap")
    first = _random_engine(2, **config)
    buckets = first.runner.buckets
    programs = 2 * (len(buckets.step_layouts()) + len(buckets.scoring_layouts()))  # per sampler: steps, scored
    assert first.runner.compilation.warmup_split == (4, programs - 4)  # each sampler's largest decode and prefill
    first.runner.compilation.wait_for_warmup()
    assert len(list(tmp_path.iterdir())) == 3  # one record per sampler's steps, one for the scored prompts
    counter = CompileCounter.install()
    warm = _random_engine(2, **config)
    assert warm.runner.compilation.warmup_split == (0, programs)
    warm.runner.compilation.wait_for_warmup()
    before = counter.count
    for i in range(4):  # 4 x up to 8 blocks of 8 tokens in 24 blocks: swaps
        prompt = list(range(3, 3 + 16 + 3 * i))
        warm.add_request(None, prompt, SamplingParams(temperature=float(i % 2), max_tokens=40, ignore_eos=True))
    while warm.has_unfinished():
        warm.step()
    assert warm.scheduler.num_preemptions["swap"] > 0
    assert counter.count == before, f"{counter.count - before} compilations after a warm start's warm-up"
    monkeypatch.setattr(compilation, "ferry_source_hash", lambda: "edited")
    edited = _random_engine(2, **config)
    assert edited.runner.compilation.warmup_split == (4, programs - 4)
    edited.runner.compilation.wait_for_warmup()


def test_warmup_of_a_deeper_model_compiles_no_more_programs():
    """The layers are one scanned program body: 1 and 6 layers compile the same number of programs."""
    counter = CompileCounter.install()
    counts = {}
    for num_layers in (1, 6):
        engine = _random_engine(num_layers)
        before = counter.count
        engine.warmup(sampling=True)
        counts[num_layers] = counter.count - before
    assert counts[1] > 0 and counts[6] <= counts[1], counts


def test_lazy_warmup_compiles_the_full_sampler_in_the_background():
    """warmup="lazy": the greedy programs before __init__ returns, the full sampler's and the scored prompts' on
    a thread; once it is done, sampled, greedy and scored requests (lm-eval's, offline: top-1 prompt logprobs,
    greedy; served: echo with logprobs=1) compile nothing."""
    counter = CompileCounter.install()
    engine = _random_engine(2, warmup="lazy")
    engine.runner.compilation.wait_for_warmup()
    before = counter.count
    rng = np.random.default_rng()
    scored = [dict(prompt_logprobs=1, temperature=0.0), dict(prompt_logprobs=1, logprobs=1, temperature=0.0)]
    for i in range(16):
        prompt = rng.integers(3, 128, size=int(rng.integers(1, 30))).tolist()
        kind = scored[i % 2] if i >= 12 else dict(temperature=float(i % 2))
        params = SamplingParams(**kind, max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
        engine.add_request(None, prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert counter.count - before == 0, f"{counter.count - before} compilations after warm-up"


# The families of tests/helpers/hf_models.ARCHS past the Llama family's first ones: windows of 8 (every layer sliding:
# one KV cache group; a full and a sliding group; Gemma 2 and 3's alternating layers), and the others' parts. Not
# llama_dynamic: dynamic NTK rotates a key by the length of the call that wrote it, so chunking, recomputing or
# reusing cached keys changes its output (in transformers too), and the parity test runs it unchunked.
FAMILIES = ["mistral_window", "qwen2_window", "gemma2", "gemma3", "phi3", "phi4_mini", "olmo2", "granite",
            "llama_yarn"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_families_give_transformers_tokens_under_chunking_caching_and_preemption(tmp_path, arch):
    """Prompts and outputs far past the windows: with ample blocks, chunked prefill and prefix caching (second
    turns resending a first turn), and under swap and recompute preemption (a late urgent request needing the
    whole cache), greedy tokens equal transformers' (ties excepted, reported). Where the model has windows,
    blocks behind them go back to the pool as requests run, and the same checkpoint without its windows gives
    other tokens (the windows are what is tested)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    torch_model = make_hf_model(arch, tmp_path, seed=seed)
    loaded = load_model(str(tmp_path))
    windowed = any(loaded.cfg.layer_windows)
    groups = kv_cache_groups(loaded.cfg).num_groups
    vocab = loaded.cfg.vocab_size
    workload = _workload(seed, vocab, n=6)  # at most 40 + 40 tokens each
    second_turns = [(p + p[:9], 12) for p, _ in workload[:3]]  # a cached first turn, crossing windows
    ties = []

    def check(name, requests, outputs):
        for i, ((prompt, max_tokens), tokens) in enumerate(zip(requests, outputs)):
            tie = check_greedy_match(tokens, *hf_greedy(torch_model, prompt, max_tokens))
            if tie:
                ties.append(f"{name} request {i}: {tie}")

    for name, config in {"ample": dict(num_blocks=256, max_num_batched_tokens=512),
                         "chunk16": dict(num_blocks=256, chunk_size=16, max_num_batched_tokens=64)}.items():
        llm = LLM(loaded, EngineConfig(block_size=8, max_num_seqs=8, **config))
        freed = _counting_window_frees(llm.engine)
        outputs = [o.outputs[0].token_ids for turns in (workload, second_turns) for o in llm.generate(
            [p for p, _ in turns], [_greedy(m) for _, m in turns], use_tqdm=False)]
        check(name, workload + second_turns, outputs)
        assert llm.engine.scheduler.stats()["prefix_cache_hits"] > 0 and (freed[0] > 0) == windowed, (name, seed)
    for mode in ("swap", "recompute"):  # the cache: what the longest request (80 tokens) needs
        engine = LLMEngine(loaded, EngineConfig(block_size=8, max_num_seqs=8, num_blocks=1 + 10 * groups,
                                                max_num_batched_tokens=512, preemption_mode=mode))
        freed, urgent = _counting_window_frees(engine), _urgent_request(engine, seed)
        check(mode, workload + [urgent], _generate_with_a_late_urgent_request(engine, workload, urgent))
        stats = engine.scheduler.stats()
        assert stats["preemptions"][mode] > 0 and (freed[0] > 0) == windowed, (mode, seed, stats)
    if windowed:
        assert_windows_change_the_prompt_logprobs(loaded, tmp_path, max((p for p, _ in workload), key=len))
    if ties:
        print(f"{arch} seed {seed}: accepted ties:", *ties, sep="\n  ")


def assert_windows_change_the_prompt_logprobs(loaded, model_dir, prompt):
    """The checkpoint in `model_dir` with every layer full attention scores `prompt` (past its windows) otherwise:
    greedy tokens can agree (a random tied-embedding model repeats a token), its log-probabilities cannot."""
    plain_dir = model_dir / "no_window"
    shutil.copytree(model_dir, plain_dir, ignore=shutil.ignore_patterns("no_window"))
    config = json.loads((plain_dir / "config.json").read_text())
    config |= dict(sliding_window=None, layer_types=["full_attention"] * config["num_hidden_layers"])
    (plain_dir / "config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    scores = [np.array([next(iter(lp.values())) for lp in LLM(model, EngineConfig(block_size=8, num_blocks=64))
                        .generate([prompt], params, use_tqdm=False)[0].prompt_logprobs[1:]])
              for model in (loaded, load_model(str(plain_dir)))]
    assert np.abs(scores[0] - scores[1]).max() > 1e-3
