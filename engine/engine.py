"""LLMEngine (step-driven, streaming deltas) and LLM (offline batch generation).

Each `LLMEngine.step()` asks the scheduler for a plan (reap, budget, admit, preempt, decode), has the
runner execute it on the device, feeds the sampled tokens back to the scheduler, detokenizes them
incrementally (stop strings included) and returns per-request deltas.
"""

import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Sequence

import jax
from tqdm.auto import tqdm

log = logging.getLogger("ferry")

WARMUP_MODES = ("full", "lazy", "none")

from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request
from engine.runner import CompileCounter, ModelRunner, RunnerOutput, kv_bytes_per_block, num_blocks_for_memory
from engine.sampling_params import MAX_SEED, SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler, SchedulerConfig
from models.loading import LoadedModel, load_model
from models.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None          # KV blocks incl. the null block; None: from the budget below
    memory_fraction: float = 0.5           # of free accelerator memory for the KV cache (not on CPU)
    cpu_kv_cache_gib: float = 4.0          # KV-cache budget on CPU, GiB (as vLLM's VLLM_CPU_KVCACHE_SPACE)
    max_num_seqs: int = 64                 # decode batch cap
    max_num_batched_tokens: int = 512      # tokens per step (decode + prefill chunks)
    max_model_len: int | None = None       # None: the model's own
    chunk_size: int | None = None          # prefill chunk cap; None: whole prompts up to the token budget
    watermark_blocks: int = 0
    preemption_mode: str = "swap"          # or "recompute"
    num_host_blocks: int | None = None     # swap space; None: as many as device blocks
    kv_dtype: str | None = None            # None: the model's dtype
    attention_impl: str | None = None      # None: by backend (pallas_kernels.attention)
    dtype: str | None = None               # model dtype when loading from a path
    seed: int = 0                          # draws the seeds of requests that give none
    warmup: str = "none"                   # compile in __init__: "full" every step shape, both samplers;
                                           # "lazy" the greedy ones, the full sampler's in the background;
                                           # "none" each shape on first use

    def __post_init__(self):
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', not {self.preemption_mode!r}")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, not {self.warmup!r}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, not {self.cpu_kv_cache_gib}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int                             # which of the request's n samples
    text: str                              # in a step's delta: the new text; in a final output: all of it
    token_ids: list[int]
    finish_reason: str | None = None       # "stop", "length", "abort"
    logprobs: list[dict[int, float]] | None = None  # per token: {id: logprob} of the sampled and top ids
    stop_reason: str | int | None = None   # the stop string or token id that ended it


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class _Sample:
    """One of a request's n samples: the scheduler's Request plus its text state."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    emitted_tokens: int = 0                # output tokens already returned in a delta
    emitted_text: int = 0                  # characters of text already returned in a delta


@dataclasses.dataclass(slots=True)
class _Group:
    """A user request: n samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    unforked: int = 0                      # samples still to fork off sample 0 once its prompt is cached
    prompt_logprobs: list | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return not self.unforked and all(s.request.is_finished for s in self.samples)


def enable_compilation_cache():
    """JAX's persistent compilation cache, so start-up compiles are paid once per machine. The
    directory comes from FERRY_COMPILATION_CACHE (default ~/.cache/ferry/jax); "0" turns it off
    (the tests do, so a compile-count regression cannot hide behind a warm cache)."""
    path = os.environ.get("FERRY_COMPILATION_CACHE", os.path.expanduser("~/.cache/ferry/jax"))
    if path == "0" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however quick to compile: a restart then loads all of them (measured: a scanned
    # step compiles in well under the default 1 s, and skipping it made warm starts compile again).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class LLMEngine:
    def __init__(self, model: LoadedModel | str, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None):
        config = config or EngineConfig()
        started = time.perf_counter()
        enable_compilation_cache()
        if isinstance(model, str):
            model = load_model(model, config.dtype)
        load_s = time.perf_counter() - started
        if tokenizer is None and model.path is not None:
            try:
                tokenizer = load_tokenizer(model.path)
            except FileNotFoundError:
                tokenizer = None  # token ids in, token ids out
        self.model, self.config, self.tokenizer = model, config, tokenizer
        max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        kv_dtype = config.kv_dtype or model.dtype
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        num_blocks = config.num_blocks or num_blocks_for_memory(
            model.cfg, config.block_size, kv_dtype, config.memory_fraction,
            cap_blocks=1 + config.max_num_seqs * math.ceil(max_model_len / config.block_size),
            cpu_budget_bytes=int(config.cpu_kv_cache_gib * 2**30))
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_tokens, max_model_len=max_model_len, chunk_size=config.chunk_size,
            watermark_blocks=config.watermark_blocks, preemption_mode=config.preemption_mode,
            num_host_blocks=num_blocks if config.num_host_blocks is None else config.num_host_blocks))
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_tokens, max_model_len=max_model_len, kv_dtype=kv_dtype,
            attention_impl=config.attention_impl)
        self.eos_token_ids = tuple(model.cfg.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer else ())
        self._groups: dict[str, _Group] = {}
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0
        self.step_times = {"schedule_s": 0.0, "execute_s": 0.0, "postprocess_s": 0.0, "steps": 0}
        cache_s = time.perf_counter() - started - load_s
        counter = CompileCounter.install()
        compiled, loaded = counter.count, counter.cache_hits
        warmup_s = self.warmup(background=True) if config.warmup == "lazy" else (
            self.warmup() if config.warmup == "full" else 0.0)
        kv_gib = num_blocks * kv_bytes_per_block(model.cfg, config.block_size, kv_dtype) / 2**30
        log.info("start-up took %.1f s: model %.1f s; KV cache %.1f s (%d blocks, %.2f GiB); warm-up=%s %.1f s "
                 "(%d programs compiled, %d loaded from the persistent compilation cache)",
                 time.perf_counter() - started, load_s, cache_s, num_blocks, kv_gib, config.warmup, warmup_s,
                 # jax reports a compile event for a program read from the cache too
                 counter.count - compiled - (counter.cache_hits - loaded), counter.cache_hits - loaded)

    def warmup(self, sampling: bool = True, background: bool = False) -> float:
        """Compile every step shape now (ModelRunner.warmup); EngineConfig.warmup does it in __init__."""
        return self.runner.warmup(sampling, background)

    # -------------------------------------------------------------- requests

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a request (a prompt string, or token ids); returns its id. Bad input raises ValueError
        (SamplingParamsError for a bad parameter, naming the field) and changes nothing."""
        params = params or SamplingParams()
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self._groups:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        text, prompt_ids = self._prompt(prompt)
        if len(prompt_ids) + 1 > self.max_model_len:  # room for at least one generated token
            raise SamplingParamsError("prompt", f"the prompt has {len(prompt_ids)} tokens; with at least one "
                                      f"token to generate it exceeds max_model_len={self.max_model_len}")
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_ids))
        base_seed = params.seed if params.seed is not None else self._seed_rng.randrange(MAX_SEED)
        samples = []
        for index in range(params.n):
            request = Request(
                request_id=f"{request_id}#{index}", prompt_token_ids=list(prompt_ids), max_tokens=max_tokens,
                priority=params.priority, eos_token_ids=self.eos_token_ids,
                stop_token_ids=tuple(params.stop_token_ids), ignore_eos=params.ignore_eos,
                min_tokens=params.min_tokens, params=params, seed=(base_seed + index) % MAX_SEED)
            samples.append(_Sample(index, request, self._detokenizer(prompt_ids, params),
                                   logprobs=[] if params.logprobs is not None else None))
            if samples[-1].detokenizer is not None:
                request.stop_checker = _stop_string_checker(samples[-1], tuple(params.stop))
        group = _Group(request_id, text, list(prompt_ids), params, samples, unforked=params.n - 1,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                       arrival_time=time.monotonic())
        self.scheduler.add(samples[0].request)  # raises (changing nothing) if it can never fit
        self._groups[request_id] = group
        return request_id

    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise SamplingParamsError("prompt", "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise SamplingParamsError("prompt", f"token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.model.cfg.vocab_size})")
        return None, ids

    def _detokenizer(self, prompt_ids, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        # Stop strings join once min_tokens are out (_stop_string_checker), as vLLM checks them.
        stops = tuple(params.stop) if params.min_tokens == 0 else ()
        return IncrementalDetokenizer(self.tokenizer, list(prompt_ids), params.skip_special_tokens,
                                      stops, params.include_stop_str_in_output)

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its samples) in any state; its blocks are freed now. False if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for sample in group.samples[:len(group.samples) - group.unforked]:
            request = self.scheduler.abort(sample.request.request_id)
            if request is not None:
                self.runner.drop_swapped(request.host_block_ids)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups) or self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    # -------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """One engine step; returns a delta for every request that advanced or finished."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        out = self.runner.execute(plan)
        t2 = time.perf_counter()
        self.scheduler.postprocess(plan, out.tokens)
        deltas = self._deltas(out)
        t3 = time.perf_counter()
        times = self.step_times
        times["schedule_s"] += t1 - t0
        times["execute_s"] += t2 - t1
        times["postprocess_s"] += t3 - t2
        times["steps"] += 1
        return deltas

    def _deltas(self, out: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        deltas = []
        for group in list(self._groups.values()):
            self._record_prompt_logprobs(group, out)
            self._fork(group)
            changed = []
            for sample in group.samples[:len(group.samples) - group.unforked]:
                if self._advance(sample, out):
                    changed.append(sample)
            if not changed:
                continue
            if group.first_token_time is None:
                group.first_token_time = now
            if group.finished:
                group.finished_time = now
                del self._groups[group.request_id]
            deltas.append(self._output(group, changed, delta=True))
        return deltas

    def _fork(self, group: _Group):
        """Once sample 0's prompt is cached, the other samples share its full prompt blocks."""
        first = group.samples[0].request
        if not group.unforked or first.in_prefill or first.is_finished and first.finish_reason == "abort":
            return
        for sample in group.samples[len(group.samples) - group.unforked:]:
            if first.is_finished:  # finished before it could be forked: a plain add
                self.scheduler.add(sample.request)
            else:
                self.scheduler.fork(first, sample.request)
        group.unforked = 0

    def _advance(self, sample: _Sample, out: RunnerOutput) -> bool:
        """Fold this step's results into `sample`; True if there is something new to report."""
        request = sample.request
        rid = request.request_id
        if sample.logprobs is not None and rid in out.logprobs:
            logprob, top = out.logprobs[rid]
            entry = dict(top)
            entry[request.output_token_ids[-1]] = logprob
            sample.logprobs.append(entry)
        if sample.detokenizer is not None and request.is_finished:
            sample.text += sample.detokenizer.flush()  # held-back text; "" once already flushed
        # Every finish comes with a token (postprocess appends, then finishes), so new tokens say it all.
        return request.num_output_tokens > sample.emitted_tokens

    def _record_prompt_logprobs(self, group: _Group, out: RunnerOutput):
        scores = out.prompt_logprobs.get(group.samples[0].request.request_id)
        if group.prompt_logprobs is not None and scores:
            ids = group.prompt_token_ids
            for logprob, top in scores:
                entry = dict(top)
                entry[ids[len(group.prompt_logprobs)]] = logprob
                group.prompt_logprobs.append(entry)

    def _output(self, group: _Group, samples, delta: bool) -> RequestOutput:
        outputs = []
        for sample in samples:
            request = sample.request
            tokens = request.output_token_ids
            start_tok = sample.emitted_tokens if delta else 0
            start_txt = sample.emitted_text if delta else 0
            outputs.append(CompletionOutput(
                index=sample.index, text=sample.text[start_txt:], token_ids=tokens[start_tok:],
                finish_reason=request.finish_reason,
                logprobs=None if sample.logprobs is None else sample.logprobs[start_tok:],
                stop_reason=_stop_reason(sample)))
            if delta:
                sample.emitted_tokens, sample.emitted_text = len(tokens), len(sample.text)
        metrics = {"arrival_time": group.arrival_time, "first_token_time": group.first_token_time,
                   "finished_time": group.finished_time}
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, group.finished,
                             group.prompt_logprobs if (group.finished or not delta) else None, metrics)


def _stop_string_checker(sample: _Sample, stops: tuple[str, ...]):
    """Feed every new token to the sample's detokenizer; report "stop" when a stop string completes.
    The stop strings count only once the output has min_tokens tokens."""

    def check(request: Request) -> str | None:
        if stops and not sample.detokenizer.stop and request.num_output_tokens >= request.min_tokens:
            sample.detokenizer.stop = stops
        sample.text += sample.detokenizer.add_token(request.output_token_ids[-1])
        return "stop" if sample.detokenizer.stopped_by is not None else None

    return check


def _stop_reason(sample: _Sample):
    request = sample.request
    if request.finish_reason != "stop":
        return None
    if sample.detokenizer is not None and sample.detokenizer.stopped_by is not None:
        return sample.detokenizer.stopped_by
    last = request.output_token_ids[-1] if request.output_token_ids else None
    return last if last in request.stop_token_ids else None


class LLM:
    """Offline batch generation: every prompt through continuous batching, outputs in input order.

        llm = LLM("models/default")
        outputs = llm.generate(["def fib(n):", "The"], SamplingParams(max_tokens=32, temperature=0))
    """

    def __init__(self, model: LoadedModel | str, config: EngineConfig | None = None, **config_kwargs):
        self.engine = LLMEngine(model, config or EngineConfig(**config_kwargs))

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """`prompts`: a string, a list of token ids, or a list of either. One SamplingParams for all, or one each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(None, prompt, p))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves no half-queued batch behind
                engine.abort(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        groups = {rid: engine._groups[rid] for rid in ids}
        t0, generated = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(finals) < len(ids):
                for delta in engine.step():
                    generated += sum(len(o.token_ids) for o in delta.outputs)
                    if delta.finished and delta.request_id in groups:
                        finals[delta.request_id] = engine._output(groups[delta.request_id],
                                                                  groups[delta.request_id].samples, delta=False)
                        bar.update(1)
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - t0, 1e-9):.1f}")
        return [finals[rid] for rid in ids]
