"""LLMEngine: the step-driven engine (streaming deltas).

Each `LLMEngine.step()` is schedule, execute, update (`step_core`): the scheduler decides the step (reap, budget,
admit, preempt, decode) and hands it over as plain data, the runner executes it on the device, and the sampled
tokens go back to the scheduler. The output side (engine/output_processor.py) then detokenizes them, matches stop
strings and returns per-request deltas (`process_outputs`, on the server's own thread).
"""

import collections
import dataclasses
import gc
import logging
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.output_processor import OutputProcessor, SampleNews, StepNews
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import MAX_SEED, SamplingParams, SamplingParamsError, is_valid_unicode
from engine.structured import CompiledGrammar, GrammarCompiler
from engine.worker.compilation import CompileCounter
from engine.worker.kv_cache import kv_bytes_per_block, num_blocks_for_memory
from engine.worker.model_runner import AsyncModelRunnerOutput, DeviceStateLost, ModelRunner
from engine.worker.multihost import agree_min
from models.loading import LoadedModel, load_model, quantize_model, unstack_layers
from models.mesh import engine_devices, loading_device, make_mesh
from models.paged import cache_page_dims, kv_cache_groups
from models.quantization import weight_bytes
from models.sharding import shard_model
from models.tokenizers.load import load_tokenizer
from models.tokenizers.tokenizer import Tokenizer
from models.transformer import pack_kernels, packs_kernels
from pallas_kernels.kernels import Kernels
from pallas_kernels.kv_quant import resolve_kv_dtype

log = logging.getLogger("ferry")


class EngineDeadError(RuntimeError):
    """The engine cannot go on: the device state is lost (a fault after the KV cache was donated, a failed
    swap copy) or the scheduler itself failed. Every request is lost; the process should restart."""


@dataclasses.dataclass(slots=True)
class _Group:
    """A user request as the core sees it: n samples of one prompt, each a scheduler Request. (Its text and
    outputs live on the output side: output_processor.OutputGroup.)"""

    request_id: str
    requests: list[Request]
    unforked: int = 0                      # samples still to add once sample 0's prompt is cached
    error: str | None = None               # the group failed: every sample ended with "error"
    pooling: PoolingParams | None = None   # an embedding request (one Request, no samples)
    pooled_sum: np.ndarray | None = None   # its final hidden states' sum over the prompt so far (mean pooling)

    @property
    def finished(self) -> bool:
        return self.error is not None or (not self.unforked and all(r.is_finished for r in self.requests))

    @property
    def started(self) -> list[Request]:
        """Samples known to the scheduler (the unforked wait for sample 0's prompt)."""
        return self.requests[:len(self.requests) - self.unforked]


def _group_of(request_id: str) -> str:
    """The user request a sample belongs to: sample i of request R is "R#i" (add_request)."""
    return request_id.rpartition("#")[0]


def enable_compilation_cache():
    """JAX's persistent compilation cache, so start-up compiles are paid once per machine. The
    directory comes from FERRY_COMPILATION_CACHE (default ~/.cache/ferry/jax); "0" turns it off
    (the tests do, so a compile-count regression cannot hide behind a warm cache)."""
    path = os.environ.get("FERRY_COMPILATION_CACHE", os.path.expanduser("~/.cache/ferry/jax"))
    if path == "0" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however quick to compile: a restart then loads all of them (a scanned step compiles in
    # under the default threshold, and skipping it made warm starts compile again).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def freeze_startup_heap() -> None:
    """For a process that serves one engine to the end: move everything start-up made (modules, traced
    programs, the model's host objects, the tokenizer) out of the cyclic GC's sight, so a collection at
    serving time walks only what requests made (vLLM's engine core does the same; scripts/benchmark_host.py
    shows what the collections cost a large batch's step). Not for processes that make and drop engines: frozen
    objects are never collected. No collection first: start-up leaves little garbage, which stays, while a full
    collection of the rest would cost a noticeable share of start-up."""
    gc.freeze()
    gc.enable()  # `python -m engine.entrypoints.serve` starts with it off (engine/entrypoints/serve.py)


def model_tokenizer(model: LoadedModel) -> Tokenizer | None:
    """The tokenizer beside the model's checkpoint; None without one (token ids in, token ids out)."""
    if model.path is None:
        return None
    try:
        return load_tokenizer(model.path)
    except FileNotFoundError:
        return None


class LLMEngine:
    def __init__(self, model: LoadedModel | str, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, devices=None):
        """`devices`: the tensor_parallel_size devices this engine runs on (default: the first ones)."""
        config = config or EngineConfig()
        started = time.perf_counter()
        enable_compilation_cache()
        mesh = make_mesh(engine_devices(config.tensor_parallel_size, devices))
        if isinstance(model, str):
            with jax.default_device(loading_device(mesh)):
                model = load_model(model, config.dtype)
        if config.quantization is not None:
            with jax.default_device(loading_device(mesh)):
                model = quantize_model(model, config.quantization, config.quantization_group_size)
        model = shard_model(model, mesh, config.expert_parallel)
        kv_dtype = resolve_kv_dtype(config.kv_dtype) if config.kv_dtype else jnp.dtype(model.dtype)
        # What the steps run, from the platform of the devices they are compiled for
        kernels = Kernels.for_mesh(mesh, model.dtype, kv_dtype, config.attention_impl)
        if not config.scan_layers:
            model = unstack_layers(model)
        elif packs_kernels(kernels, model.dtype, config.tensor_parallel_size):  # the native matmul's layout
            model = dataclasses.replace(model, state=pack_kernels(model.graphdef, model.state))
        load_s = time.perf_counter() - started
        tokenizer = tokenizer or model_tokenizer(model)
        self.model, self.config, self.tokenizer = model, config, tokenizer
        max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        kv_groups = kv_cache_groups(model.cfg)
        page_dims = cache_page_dims(model.cfg, kernels, kv_dtype, mesh.size)
        num_blocks = config.num_blocks or num_blocks_for_memory(
            model.cfg, config.block_size, kv_dtype, config.memory_fraction,
            cap_blocks=1 + config.max_num_seqs * math.ceil(max_model_len / config.block_size) * kv_groups.num_groups,
            cpu_budget_bytes=int(config.cpu_kv_cache_gib * 2**30), devices=list(mesh.devices.flat),
            page_dims=page_dims)
        if jax.process_count() > 1:  # multi-host: every process must allocate the same cache
            num_blocks = agree_min("num_blocks", num_blocks)
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_tokens, max_model_len=max_model_len, chunk_size=config.chunk_size,
            watermark_blocks=config.watermark_blocks, preemption_mode=config.preemption_mode,
            num_host_blocks=num_blocks if config.num_host_blocks is None else config.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching, group_windows=kv_groups.windows))
        self.runner = ModelRunner(
            model, kernels=kernels, num_blocks=num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_model_len,
            kv_dtype=kv_dtype, mesh=mesh)
        self.eos_token_ids = tuple(model.cfg.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer else ())
        self._groups: dict[str, _Group] = {}
        # The last decode batch (a copy), its group ids and sample indices: StepNews.decoded's first columns
        self._decode_keys: tuple[list, list[str], list[int]] = ([], [], [])
        # The steps executed and not yet updated, newest first: (SchedulerOutput, its AsyncModelRunnerOutput).
        # Two at most, under async scheduling: one in flight, and the one scheduled ahead of its update.
        self._batch_queue: collections.deque[tuple[SchedulerOutput, AsyncModelRunnerOutput]] = collections.deque()
        # text and RequestOutputs: step(), or the server's output thread
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids)
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first structured request
        self._grammar_compiler_lock = threading.Lock()
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0
        # "planned_ahead": steps scheduled and dispatched before the last one's tokens were in (async scheduling);
        # "deferred": of those, steps that failed to start and ran synchronously a call later
        self.step_times = {"schedule_s": 0.0, "execute_s": 0.0, "postprocess_s": 0.0, "outputs_s": 0.0, "steps": 0,
                           "planned_ahead": 0, "deferred": 0}
        cache_s = time.perf_counter() - started - load_s
        counter = CompileCounter.install()
        compiled, loaded = counter.count, counter.cache_hits
        warmup_s = self.warmup(background=True) if config.warmup == "lazy" else (
            self.warmup() if config.warmup == "full" else 0.0)
        block_bytes = kv_bytes_per_block(model.cfg, config.block_size, kv_dtype, page_dims)
        # What the weights and the KV cache take, as stored (quantized weights packed; a quantized KV row's
        # scale): the log line, /metrics
        self.memory = {"weight_bytes": weight_bytes(model.state), "kv_cache_bytes": num_blocks * block_bytes,
                       "kv_bytes_per_token": block_bytes // config.block_size}
        log.info("start-up took %.1f s: model %.1f s (weights %.1f MiB%s); KV cache %.1f s (%d blocks, %.2f GiB, "
                 "%s, %d bytes a token); warm-up=%s %.1f s (%d programs compiled, %d loaded from the persistent "
                 "compilation cache)",
                 time.perf_counter() - started, load_s, self.memory["weight_bytes"] / 2**20,
                 f", {config.quantization}" if config.quantization else "", cache_s, num_blocks,
                 self.memory["kv_cache_bytes"] / 2**30, kv_dtype.name, self.memory["kv_bytes_per_token"],
                 config.warmup, warmup_s,
                 # jax reports a compile event for a program read from the cache too
                 counter.count - compiled - (counter.cache_hits - loaded), counter.cache_hits - loaded)

    def warmup(self, sampling: bool = True, background: bool = False) -> float:
        """Compile every step shape now (ModelRunner.warmup); EngineConfig.warmup does it in __init__. With
        EngineConfig.task "embed", every pooling program instead, before returning (ModelRunner.warmup_pooling)."""
        if self.config.task == "embed":
            return self.runner.warmup_pooling()
        return self.runner.warmup(sampling, background)

    # -------------------------------------------------------------- requests

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | PoolingParams | None = None, *, cache_salt: str | None = None,
                    final_only: bool = False) -> str:
        """Queue a request (a prompt string, or token ids); returns its id. Bad input raises ValueError
        (SamplingParamsError for a bad parameter, naming the field) and changes nothing. Requests share
        cached prompt blocks only when their `cache_salt`s are equal (None: the common namespace).
        `final_only`: step() returns no delta for it until it finishes, and then one with all of its output (as
        vLLM's RequestOutputKind.FINAL_ONLY): for callers that read only final outputs, it saves the output
        side rendering a delta per request per step. With PoolingParams it is an embedding request: its prompt
        is prefilled and it finishes, its one output an EmbeddingRequestOutput (always final only)."""
        params = params or SamplingParams()
        if not isinstance(params, PoolingParams) and self.config.task == "embed":
            raise ValueError("this engine's task is 'embed' (EngineConfig.task, --task): it serves embedding "
                             "requests (PoolingParams, /v1/embeddings), not generation")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise SamplingParamsError("cache_salt", f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self._groups:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        text, prompt_ids = self._prompt(prompt)
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt_ids, params, cache_salt)
            return request_id
        stop_token_ids = self._stop_token_ids(params)
        if len(prompt_ids) + 1 > self.max_model_len:  # room for at least one generated token
            raise SamplingParamsError("prompt", f"the prompt has {len(prompt_ids)} tokens; with at least one "
                                      f"token to generate it exceeds max_model_len={self.max_model_len}")
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_ids))
        base_seed = params.seed if params.seed is not None else self._seed_rng.randrange(MAX_SEED)
        grammar = self.compile_grammar(params.structured_outputs) if params.structured_outputs else None
        requests = [Request(
            request_id=f"{request_id}#{index}", group_id=request_id, sample_index=index,
            prompt_token_ids=list(prompt_ids), max_tokens=max_tokens,
            priority=params.priority, eos_token_ids=self.eos_token_ids, stop_token_ids=stop_token_ids,
            ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, params=params,
            seed=(base_seed + index) % MAX_SEED, cache_salt=cache_salt,
            grammar=grammar.matcher() if grammar is not None else None) for index in range(params.n)]
        self.outputs.register(request_id, text, prompt_ids, params, stop_token_ids,  # raises on bad stop strings
                              final_only=final_only)
        try:
            self.scheduler.add(requests[0])  # raises (changing nothing) if it can never fit
        except Exception:
            self.outputs.forget(request_id)
            raise
        self._groups[request_id] = _Group(request_id, requests, unforked=params.n - 1)
        return request_id

    def _add_pooling_request(self, request_id: str, prompt_ids: list[int], params: PoolingParams,
                             cache_salt: str | None) -> None:
        """An embedding request: one Request whose prefill target is its prompt and which generates nothing."""
        if len(prompt_ids) > self.max_model_len:
            raise SamplingParamsError("prompt", f"the prompt has {len(prompt_ids)} tokens, more than "
                                      f"max_model_len={self.max_model_len}")
        request = Request(request_id=f"{request_id}#0", group_id=request_id, prompt_token_ids=list(prompt_ids),
                          max_tokens=0, cache_salt=cache_salt, pooling=params.pooling_type)
        self.outputs.register_pooling(request_id, prompt_ids)
        try:
            self.scheduler.add(request)  # raises (changing nothing) if it can never fit
        except Exception:
            self.outputs.forget(request_id)
            raise
        self._groups[request_id] = _Group(request_id, [request], pooling=params)

    def compile_grammar(self, spec, field: str = "structured_outputs") -> CompiledGrammar:
        """The compiled grammar of a StructuredOutputsParams (cached); a bad one raises SamplingParamsError(field).
        Thread-safe: the server compiles on worker threads, off the engine thread."""
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise SamplingParamsError(field, "structured outputs need a tokenizer, and this model has none")
                self._grammar_compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.model.cfg.vocab_size,
                                                                       self.eos_token_ids)
        return self._grammar_compiler.compile(spec, field)

    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            if not prompt:
                raise SamplingParamsError("prompt", "the prompt is empty")
            if not is_valid_unicode(prompt):
                raise SamplingParamsError("prompt", "the prompt is not valid Unicode (it holds a lone surrogate)")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise SamplingParamsError("prompt", "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise SamplingParamsError("prompt", f"token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.model.cfg.vocab_size})")
        return None, ids

    def _stop_token_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The request's stop ids, deduplicated; each must be a vocabulary id (they are masked on the device)."""
        vocab_size = self.model.cfg.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {vocab_size})")
        return tuple(dict.fromkeys(params.stop_token_ids))

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its samples) in any state; its blocks are freed now. False if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for request in group.started:
            self._abort_request(request, "abort")
        self.outputs.forget(request_id)
        return True

    def _abort_request(self, request: Request, reason: str) -> None:
        """End one sample in any state, freeing its blocks now (a no-op once it finished)."""
        self.scheduler.abort(request.request_id, reason)

    def has_unfinished(self) -> bool:
        return bool(self._groups) or self.scheduler.has_unfinished() or bool(self._batch_queue)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (e.g. after swapping weights); False, changing nothing, while a
        running request holds a cached block."""
        return self.scheduler.reset_prefix_cache()

    @property
    def num_requests(self) -> int:
        return len(self._groups)

    def full_output(self, request_id: str) -> Callable[[], RequestOutput]:
        """A function that renders the request's whole output so far (not a delta), also once finished."""
        group = self.outputs.groups[request_id]
        return lambda: self.outputs.render(group, group.samples, delta=False)

    def stats(self) -> dict:
        """The scheduler's counters (Scheduler.stats), for metrics and logs."""
        return self.scheduler.stats()

    def last_step_trace(self) -> list:
        """The scheduler's decisions in the last step: [(phase, info), ...]."""
        return self.scheduler.step_traces[-1] if self.scheduler.step_traces else []

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.block_pool.num_total

    @property
    def timings(self) -> dict:
        """Cumulative seconds by phase (schedule, execute, update: "postprocess_s"; the runner's pack and device
        shares of execute) and the step count."""
        return self.step_times | self.runner.timings

    # -------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """One engine step; returns a delta for every request that advanced or finished: the core step, then
        its outputs, then the stop strings those found (each ends its request before the next step)."""
        deltas = self.process_outputs(self.step_core())
        self._apply_output_finishes()
        return deltas

    def process_outputs(self, news: StepNews) -> list[RequestOutput]:
        """The output side of a step (OutputProcessor.process): here, or on the server's output thread."""
        t0 = time.perf_counter()
        deltas = self.outputs.process(news)
        self.step_times["outputs_s"] += time.perf_counter() - t0
        return deltas

    @staticmethod
    def step_trace(news: StepNews) -> list:
        """The scheduler's decisions in the step that made `news`: [(phase, info), ...]."""
        return news.trace

    def step_core(self) -> StepNews:
        """The step without its text: schedule, execute, update. Returns the step's news for the output side
        (self.outputs.process, here or on another thread).

        Async scheduling (EngineConfig.async_scheduling): a step that only decodes, with no row that needs its
        last token on the host first (a grammar, penalties, min_tokens), is dispatched and left running
        (ModelRunner.execute_model); the next call schedules and dispatches the step after it, whose rows take
        their input tokens from the device, and only then updates the first one with its tokens (its news is what
        that call returns). So the device does not wait for the host's scheduling, packing and updating between
        decode steps. A call that cannot schedule ahead (anything to admit, a prefill chunk, too few free blocks)
        only updates the step in flight; the next one schedules as usual.

        Fault isolation: a request whose step fails (its inputs, its sampling, its detokenizing) ends with
        finish_reason "error" and its blocks freed, and the rest of the batch goes on. Only a fault that leaves
        the device state unknown raises EngineDeadError."""
        t0 = time.perf_counter()
        self._apply_output_finishes()
        batch_queue = self._batch_queue
        t1 = t0
        if not batch_queue or (batch_queue[0][1].in_flight and self.scheduler.can_schedule_ahead()):
            ahead = bool(batch_queue)
            scheduler_output = self._schedule(ahead)
            t1 = time.perf_counter()
            output = self._execute(scheduler_output)
            if ahead and not (output.in_flight or output.deferred):
                # Nothing to run: the batch ended in the step in flight. Done now, not queued behind it.
                self._update(scheduler_output, output.get_output())
            else:
                self.step_times["planned_ahead"] += ahead
                self.step_times["deferred"] += output.deferred
                batch_queue.appendleft((scheduler_output, output))
                if len(batch_queue) == 1 and output.in_flight:  # its tokens come with the next call's news
                    return self._timed(t0, t1, time.perf_counter(), StepNews([], {}, {}, [], time.monotonic()))
        scheduler_output, output = batch_queue.pop()
        try:
            runner_output = output.get_output()  # waits for the device
        except DeviceStateLost as e:
            raise EngineDeadError(str(e)) from e
        t2 = time.perf_counter()
        return self._timed(t0, t1, t2, self._update(scheduler_output, runner_output))

    def _schedule(self, ahead: bool) -> SchedulerOutput:
        try:
            return self.scheduler.schedule(ahead=ahead)
        except Exception as e:
            raise EngineDeadError(f"the scheduler failed: {e!r}") from e

    def _execute(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        try:
            return self.runner.execute_model(scheduler_output, non_block=self.config.async_scheduling)
        except DeviceStateLost as e:
            raise EngineDeadError(str(e)) from e

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> StepNews:
        """Fold a step's tokens into its requests (Scheduler.update_from_output), after failing the requests the
        runner found failing; the step's news for the output side. Its batch may hold requests that ended after
        it was scheduled (an abort; under async scheduling a stop in the step before, so their rows ran one token
        too many): those are left out of its news."""
        errors = {}
        for req_id, error in runner_output.failed.items():
            group_id = _group_of(req_id)
            if group_id in self._groups:
                errors[group_id] = self._fail_group(group_id, error)
        plan, finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        if plan.stale or errors:  # the news of the others only, request by request (the columns are the batch's)
            stale = set(plan.stale)
            plan = dataclasses.replace(plan, decodes=[r for r in plan.decodes if r not in stale])
            finished = None
        return self._news(plan, runner_output, finished, errors)

    def _news(self, plan, out: ModelRunnerOutput, finished: list[Request] | None, errors: dict[str, str]) -> StepNews:
        """An updated step's news for the output side (`finished`: as _sample_news takes it); then the groups
        it forked or ended are forked or retired."""
        samples, decoded, finished_groups = self._sample_news(plan, out, finished)
        embeddings = self._pooled_news(plan, out) if out.pooler_output else {}
        news = StepNews(samples, self._prompt_logprobs_news(out), errors, plan.trace, time.monotonic(), decoded,
                        embeddings)
        self._fork_and_retire(plan, finished_groups | errors.keys() | embeddings.keys())
        return news

    def _timed(self, t0: float, t1: float, t2: float, news: StepNews) -> StepNews:
        """Add a step's phases (schedule until t1, execute until t2, update until now) to step_times."""
        times = self.step_times
        times["schedule_s"] += t1 - t0
        times["execute_s"] += t2 - t1
        times["postprocess_s"] += time.perf_counter() - t2
        times["steps"] += 1
        return news

    def check_invariants(self) -> None:
        """Scheduler.check_invariants (it knows the steps executed and not yet updated): between steps."""
        self.scheduler.check_invariants()

    def _sample_news(self, plan, out: ModelRunnerOutput,
                     finished: list[Request] | None) -> tuple[list[SampleNews], tuple, set[str]]:
        """Each sample that gained a token this step (the update appended it), but for groups that failed
        this step or were aborted: as SampleNews tuples, and the decode batch's as StepNews.decoded columns when
        it can; and the groups of those that finished. `finished`: the requests the update finished, when no
        group failed this step (else None). O(this step's requests), as comprehensions: this runs over the whole
        batch every step."""
        groups, logprobs = self._groups, out.logprobs
        # The decode tokens are the batch's, row for row, unless the batch lost requests since (then finished is
        # None) or the step ran in parts (then they are in out.sampled)
        columns = finished is not None and not logprobs and out.decode_tokens is not None
        news = []
        for requests in ([chunk.request for chunk in plan.prefills if chunk.samples], [] if columns else plan.decodes):
            news += [(r.group_id, r.sample_index, r.output_token_ids[-1],
                      logprobs.get(r.request_id) if logprobs else None, r.finish_reason)
                     for r in requests if (group := groups.get(r.group_id)) is not None and group.error is None]
        if not columns:
            return news, (), {group_id for group_id, *_, finish_reason in news if finish_reason is not None}
        # No group failed, and nothing else ends a sample between schedule and update on this thread, so every
        # decoder's group is live and error free, and the finished requests are the update's: no look-ups,
        # and the columns of group ids and sample indices stay while the batch does.
        decodes = plan.decodes
        if decodes != self._decode_keys[0]:  # an identity compare, in C
            self._decode_keys = (list(decodes), [r.group_id for r in decodes], [r.sample_index for r in decodes])
        nones = [None] * len(decodes)
        reasons = [r.finish_reason for r in decodes] if finished else nones
        return news, (*self._decode_keys[1:], out.decode_tokens, nones, reasons), {r.group_id for r in finished}

    def _pooled_news(self, plan, out: ModelRunnerOutput) -> dict[str, np.ndarray]:
        """Fold each embedding chunk's pooled rows into its request: the sums add up over the prompt (a chunk at
        position 0 starts them again: a recompute-preempted prefill runs its chunks again; a swapped one goes on
        where it was); the last chunk's last row and the sum make the embedding. Returns the embeddings finished
        this step, by request id."""
        finished = {}
        for chunk in plan.prefills:
            request = chunk.request
            pooled = out.pooler_output.get(request.request_id)
            group = self._groups.get(request.group_id)
            if pooled is None or group is None or group.error is not None:
                continue
            row_sum, last_row = pooled
            group.pooled_sum = row_sum if chunk.start == 0 or group.pooled_sum is None else group.pooled_sum + row_sum
            if request.finish_reason == "stop":  # its prompt is all computed (Scheduler.update_from_output)
                finished[group.request_id] = group.pooling.pool(group.pooled_sum, last_row, request.num_prompt_tokens)
        return finished

    def _prompt_logprobs_news(self, out: ModelRunnerOutput) -> dict[str, list]:
        return {_group_of(request_id): scores for request_id, scores in out.prompt_logprobs.items()}

    def _fork_and_retire(self, plan, ended: set[str]) -> None:
        """Fork groups whose first sample's prompt is in; drop the `ended` groups (a sample finished, or the
        group failed) once every sample has finished."""
        for chunk in plan.prefills:
            group = self._groups.get(chunk.request.group_id)
            if group is not None and group.unforked and chunk.request is group.requests[0]:
                self._fork(group)
        for group_id in ended:
            self._retire(group_id)

    def _fork(self, group: _Group):
        """The other samples join once sample 0's prompt is computed: its full prompt blocks are then in
        the prefix cache, so their admission shares them (with caching off, each prefills its own)."""
        first = group.requests[0]
        if first.in_prefill or group.error is not None:
            return
        for request in group.requests[len(group.requests) - group.unforked:]:
            self.scheduler.add(request)
        group.unforked = 0

    def _retire(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is not None and group.finished:
            del self._groups[group_id]

    def _apply_output_finishes(self) -> None:
        """End the samples the output side found finished: a stop string, or text that failed."""
        while True:
            try:
                kind, group_id, detail = self.outputs.finishes.get_nowait()
            except queue.Empty:
                return
            group = self._groups.get(group_id)
            if group is None:
                continue
            if kind == "stop":
                self._abort_request(group.requests[detail], "stop")
            elif group.error is None:
                self._end_group(group, detail)
            self._retire(group_id)

    def _fail_group(self, group_id: str, error: BaseException) -> str:
        """End every sample of a failed request with "error", freeing its blocks; returns the error."""
        group = self._groups[group_id]
        if group.error is None:
            log.error("request %s failed: %r", group_id, error)
            self._end_group(group, f"{type(error).__name__}: {error}")
        return group.error

    def _end_group(self, group: _Group, error: str) -> None:
        group.error = error
        for request in group.started:
            self._abort_request(request, "error")
        for request in group.requests:
            request.finish("error")
