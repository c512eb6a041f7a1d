"""An OpenAI-compatible HTTP server over LLMEngine (FastAPI; run it with `python -m engine.serve`).

Threads. The engine is touched by exactly one thread, the engine loop (`EngineLoop`). HTTP handlers run
on the asyncio event loop and talk to it through a thread-safe command queue (add, abort), applied at
the top of every loop iteration, so an abort frees its blocks before the next step. When idle the
engine thread blocks on that queue (no busy spin). Each API request gets an `OutputStream`: an
asyncio.Queue the engine thread fills with the step's deltas through one `call_soon_threadsafe` per
step, so a step never waits on the event loop and the event loop never waits on a step.

Lifecycle of a request: validate and tokenize on the event loop (errors are 4xx before anything is
queued) -> admission (a bounded count of requests not yet generating; past it 503 + Retry-After) ->
add command -> the engine thread accepts or rejects it (a rejection becomes a 400) -> deltas until
finished. However the handler ends (done, error, client disconnect, server shutdown) `OutputStream.close`
aborts what is unfinished, so nothing a client does can leave blocks behind.

Endpoints: POST /v1/completions, /v1/chat/completions (both with `stream`), GET /v1/models, /health,
/metrics, and vLLM's POST /tokenize, /detokenize. Errors are OpenAI's `{"error": {message, type, param,
code}}`; request validation errors are 400 (not FastAPI's 422), as OpenAI and vLLM answer them.
"""

import abc
import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.engine import CompletionOutput, LLMEngine, RequestOutput
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams, SamplingParamsError
from models.tokenizer import ChatTemplateError

log = logging.getLogger("ferry.server")

MAX_CHOICES = 128              # n x prompts per API request: bounds what one request can queue
RETRY_AFTER_S = 1              # advertised to clients turned away by admission control
UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics"})
# apply_chat_template's own arguments: chat_template_kwargs may not override them (a client-chosen template).
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "chat_template", "tools"})


@dataclasses.dataclass(slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None     # None: no authentication
    max_waiting: int | None = None  # requests admitted but not yet generating; None: unbounded
    log_interval_s: float = 5.0


# ====================================================================== errors

class APIError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class EngineUnavailable(RuntimeError):
    """The engine loop stopped (shutdown) or died; in-flight and new requests fail with it."""


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the top-level field, as OpenAI's `param` does."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = loc[0] if loc else None
    where = f"{'.'.join(loc)}: " if loc else "request body: "
    return bad_request(where + first["msg"], param)


# ====================================================================== request schemas

class _RequestModel(BaseModel):
    # Unknown fields are ignored with a warning, as vLLM does; clients send provider-specific extras.
    model_config = ConfigDict(extra="allow")

    def model_post_init(self, _context):
        if self.model_extra:
            log.warning("ignoring unsupported request fields: %s", sorted(self.model_extra))


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(_RequestModel):
    """The fields completions and chat share: OpenAI's sampling fields and vLLM's extensions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        param_names: dict[str, str]) -> SamplingParams:
        """SamplingParams from the request; null fields take SamplingParams' defaults. A bad value is a 400
        naming the API field (`param_names` maps SamplingParams names that differ from the API's)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs)
        except SamplingParamsError as e:
            raise bad_request(str(e), param_names.get(e.field, e.field)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# The request fields passed to SamplingParams as they are (None: SamplingParams' default).
SAMPLING_FIELDS = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                   "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "priority",
                   "skip_special_tokens", "include_stop_str_in_output")


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self):
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n (only n samples are generated)", "best_of")


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) pass through to the chat template, as transformers does.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ChatContentPart] | None = None

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                raise bad_request("only text content parts are supported", "messages")
            message["content"] = "\n".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None              # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def output_token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_per_token(self) -> int | None:
        """SamplingParams.logprobs: top_logprobs when logprobs is on (0 = the chosen token only)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None     # default: true for a prompt, false for messages (the template's)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_RequestModel):
    model: str | None = None
    tokens: list[int]


# ====================================================================== the engine thread

@dataclasses.dataclass(slots=True)
class AdmissionControl:
    """Bounds the engine requests admitted but not yet generating: queued for the engine thread, waiting in
    the scheduler, or prefilling. Touched only on the event loop."""

    max_waiting: int | None
    num_waiting: int = 0

    def admit(self, n: int) -> bool:
        if self.max_waiting is not None and self.num_waiting + n > self.max_waiting:
            return False
        self.num_waiting += n
        return True

    def started(self, n: int = 1) -> None:
        self.num_waiting -= n


class OutputStream:
    """The engine requests of one API request (one per prompt): their deltas, pushed by the engine thread,
    read by the one coroutine that serves the request. Iterate it for RequestOutput deltas; `close()` it
    when done, which aborts whatever has not finished."""

    def __init__(self, request_ids: list[str], admission: AdmissionControl, abort: Callable[[list[str]], None]):
        self.request_ids = request_ids
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future = self.loop.create_future()  # None, or the engine's rejection
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._not_started = set(request_ids)   # admission slots still held
        self._admission = admission
        self._abort = abort
        self._closed = False

    # ------------------------------------------------------------ event loop side

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        self._release(item.request_id)
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        """Idempotent. Releases the admission slots still held and aborts the unfinished engine requests."""
        if self._closed:
            return
        self._closed = True
        self._admission.started(len(self._not_started))
        self._not_started.clear()
        if self._unfinished:
            self._abort(sorted(self._unfinished))
            self._unfinished.clear()

    def _release(self, request_id: str) -> None:
        if request_id in self._not_started:
            self._not_started.discard(request_id)
            self._admission.started()

    # ------------------------------------------------------------ scheduled by the engine thread

    def settle(self, error: BaseException | None) -> None:
        """The engine thread accepted the request (None) or rejected it (the error)."""
        if self.accepted.done():  # the handler gave up waiting (cancelled)
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self._unfinished.clear()  # nothing was added: nothing to abort
            self.accepted.set_exception(error)

    def deliver(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


@dataclasses.dataclass(slots=True)
class _Add:
    stream: OutputStream
    prompts: list[list[int]]
    params: SamplingParams
    arrival_time: float            # time.monotonic() when the server received the API request


@dataclasses.dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass(slots=True)
class _Stop:
    pass


@dataclasses.dataclass(slots=True)
class _Tracked:
    """The engine thread's record of one engine request, for routing its deltas and for metrics."""

    stream: OutputStream
    arrival_time: float
    num_prompt_tokens: int
    num_samples: int
    num_finished_samples: int = 0
    scheduled: bool = False
    last_delta_time: float | None = None


def _deliver(items: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.deliver(item)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed: the server is gone, and so is the reader
        pass


class EngineLoop:
    """Runs the LLMEngine on its own thread: applies commands, steps while there is work, routes deltas to
    the OutputStreams, records metrics, and logs throughput every `log_interval_s`."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, log_interval_s: float = 5.0):
        self.engine = engine
        self.metrics = metrics
        self.error: BaseException | None = None  # set if the loop died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards _accepting: once the loop stops, no add may slip into the queue after its final drain.
        self._lock = threading.Lock()
        self._accepting = True
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._throughput = _ThroughputLog(log_interval_s)
        self._thread = threading.Thread(target=self._run, name="ferry-engine-loop", daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight (its readers get EngineUnavailable) and end the thread."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._accepting and self._thread.is_alive()

    def add(self, stream: OutputStream, prompts: list[list[int]], params: SamplingParams,
            arrival_time: float) -> None:
        with self._lock:
            if not self._accepting:
                raise EngineUnavailable("the engine is not running")
            self._commands.put(_Add(stream, prompts, params, arrival_time))

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(request_ids))

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:  # a bug in the engine: fail every reader rather than hang it
            log.exception("the engine loop died")
            self.error = e
            self._fail_all(EngineUnavailable(f"the engine failed: {e!r}"))

    def _iterate(self) -> bool:
        """One loop iteration: commands, then a step if there is work. False once stopped."""
        busy = self.engine.has_unfinished()
        for command in self._take_commands(block=not busy):
            if isinstance(command, _Stop):
                self._fail_all(EngineUnavailable("the server is shutting down"))
                return False
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._abort(command.request_ids)
        if self.engine.has_unfinished():
            self._step()
        stats = self.engine.scheduler.stats()
        self.metrics.record_scheduler_stats(stats)
        self._throughput.maybe_log(stats)
        return True

    def _take_commands(self, block: bool) -> list:
        commands = []
        if block:  # idle: sleep until a command comes, waking only to log
            try:
                commands.append(self._commands.get(timeout=self._throughput.seconds_to_next_log()))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Add) -> None:
        stream, params = command.stream, command.params
        added = []
        try:
            for request_id, prompt in zip(stream.request_ids, command.prompts):
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except Exception as e:  # all or nothing: a rejected prompt takes its siblings with it
            for request_id in added:
                self.engine.abort(request_id)
            _call_soon(stream.loop, stream.settle, e)
            return
        for request_id, prompt in zip(stream.request_ids, command.prompts):
            self._tracked[request_id] = _Tracked(stream, command.arrival_time, len(prompt), params.n)
        _call_soon(stream.loop, stream.settle, None)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if self.engine.abort(request_id) and tracked is not None:
                for _ in range(tracked.num_samples - tracked.num_finished_samples):
                    self.metrics.record_finished_sample("abort")

    def _step(self) -> None:
        step_start = time.monotonic()
        outputs = self.engine.step()
        now = time.monotonic()
        self._note_first_scheduled(step_start)
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            self._record(output, tracked, step_start, now)
            deliveries.setdefault(tracked.stream.loop, []).append((tracked.stream, output))
        for loop, items in deliveries.items():  # one wake-up of the event loop per step, not per request
            _call_soon(loop, _deliver, items)

    def _note_first_scheduled(self, step_start: float) -> None:
        """Queue time ends when the scheduler first admits a request; the step's trace names who it admitted
        (sample ids `<request id>#<sample>`)."""
        trace = self.engine.scheduler.step_traces[-1] if self.engine.scheduler.step_traces else []
        for phase, info in trace:
            if phase != "admit":
                continue
            for sample_id in list(info.get("admitted", ())) + list(info.get("pending", ())):
                tracked = self._tracked.get(sample_id.rpartition("#")[0])
                if tracked is not None and not tracked.scheduled:
                    tracked.scheduled = True
                    self.metrics.request_queue_time.observe(step_start - tracked.arrival_time)

    def _record(self, output: RequestOutput, tracked: _Tracked, step_start: float, now: float) -> None:
        m = self.metrics
        num_new = sum(len(o.token_ids) for o in output.outputs)
        m.generation_tokens.inc(num_new)
        if tracked.last_delta_time is None:  # its prompt is processed: count it once
            m.time_to_first_token.observe(now - tracked.arrival_time)
            m.prompt_tokens.inc(tracked.num_prompt_tokens)
            self._throughput.add(tracked.num_prompt_tokens, 0)
            if not tracked.scheduled:  # the trace did not say (should not happen): the best bound we have
                tracked.scheduled = True
                m.request_queue_time.observe(step_start - tracked.arrival_time)
        else:
            m.inter_token_latency.observe(now - tracked.last_delta_time)
        tracked.last_delta_time = now
        self._throughput.add(0, num_new)
        for o in output.outputs:
            if o.finish_reason is not None:
                tracked.num_finished_samples += 1
                m.record_finished_sample(o.finish_reason)
        if output.finished:
            m.e2e_request_latency.observe(now - tracked.arrival_time)
            del self._tracked[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        """Stop accepting, abort everything, and hand `error` to every reader and every waiting handler."""
        with self._lock:
            self._accepting = False
        for request_id in list(self._tracked):
            tracked = self._tracked.pop(request_id)
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            _call_soon(tracked.stream.loop, tracked.stream.deliver, error)
        # Adds not yet applied: their handlers still wait for acceptance.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                _call_soon(command.stream.loop, command.stream.settle, error)


class _ThroughputLog:
    """vLLM-style periodic log line: prompt and generation throughput, queue sizes, KV cache usage."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._was_active = False

    def add(self, prompt_tokens: int, generation_tokens: int) -> None:
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens

    def seconds_to_next_log(self) -> float:
        return max(0.0, self._last_log + self.interval_s - time.monotonic())

    def maybe_log(self, stats: dict) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        active = bool(self._prompt_tokens or self._generation_tokens or stats["num_running"]
                      or stats["num_waiting"] or stats["num_swapped"])
        if active or self._was_active:  # an idle server logs one all-zero line, then stays quiet
            log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                     "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                     "host KV cache usage: %.1f%%", self._prompt_tokens / elapsed,
                     self._generation_tokens / elapsed, stats["num_running"], stats["num_swapped"],
                     stats["num_waiting"], 100 * stats["kv_usage"], 100 * stats.get("host_usage", 0.0))
        self._was_active = active
        self._last_log, self._prompt_tokens, self._generation_tokens = now, 0, 0


# ====================================================================== responses

@dataclasses.dataclass(slots=True)
class _ChoiceState:
    """One choice's output so far."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0               # completions' logprobs.text_offset of the next streamed token


class _ResponseBuilder(abc.ABC):
    """Turns one API request's engine deltas into OpenAI choices: streamed chunks as they come, or the
    whole response at the end. Choice i*n + j is sample j of prompt i. Subclasses give the shapes."""

    def __init__(self, request_id: str, model: str, stream: OutputStream, n: int, prompts: list[list[int]],
                 tokenizer, num_top_logprobs: int | None):
        self.id, self.model, self.n, self.created = request_id, model, n, int(time.time())
        self.tokenizer, self.num_top_logprobs = tokenizer, num_top_logprobs
        self._prompt_index = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        self.choices = [_ChoiceState() for _ in range(len(prompts) * n)]
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.completion_tokens = 0

    def add(self, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Fold a delta in; returns (choice index, its delta) for each choice that moved."""
        base = self._prompt_index[output.request_id] * self.n
        moved = []
        for delta in output.outputs:
            choice = self.choices[base + delta.index]
            choice.text += delta.text
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs or []
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            self.completion_tokens += len(delta.token_ids)
            moved.append((base + delta.index, delta))
        return moved

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""

    def worth_a_chunk(self, delta: CompletionOutput) -> bool:
        # Empty text is held back (a partial character, a possible stop string); tokens with logprobs
        # are reported anyway.
        return bool(delta.text or delta.finish_reason or self.num_top_logprobs is not None)

    def opening_chunks(self) -> list[dict]:
        return []

    @abc.abstractmethod
    def chunk(self, index: int, delta: CompletionOutput) -> dict:
        """One streamed chunk for `delta` of choice `index`."""

    @abc.abstractmethod
    def usage_chunk(self) -> dict:
        """The final streamed chunk carrying usage."""

    @abc.abstractmethod
    def response(self) -> dict:
        """The whole non-streamed response."""


class _CompletionBuilder(_ResponseBuilder):
    def _header(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]], text_offset: int) -> dict | None:
        if self.num_top_logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        # As vLLM: each position's top_logprobs holds the top k and the sampled token.
        return {"tokens": tokens, "token_logprobs": [entry[t] for t, entry in zip(token_ids, entries)],
                "top_logprobs": [{self.token_text(t): lp for t, lp in _by_logprob(entry)} for entry in entries],
                "text_offset": offsets}

    @staticmethod
    def _choice(index: int, text: str, logprobs: dict | None, c: _ChoiceState | CompletionOutput) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def chunk(self, index: int, delta: CompletionOutput) -> dict:
        choice = self.choices[index]
        logprobs = self._logprobs(delta.token_ids, delta.logprobs or [], choice.text_offset)
        if logprobs is not None:
            choice.text_offset += sum(len(token) for token in logprobs["tokens"])
        return {**self._header(), "choices": [self._choice(index, delta.text, logprobs, delta)]}

    def usage_chunk(self) -> dict:
        return {**self._header(), "choices": [], "usage": self.usage()}

    def response(self) -> dict:
        choices = [self._choice(i, c.text, self._logprobs(c.token_ids, c.logprobs, 0), c)
                   for i, c in enumerate(self.choices)]
        return {**self._header(), "choices": choices, "usage": self.usage()}


class _ChatBuilder(_ResponseBuilder):
    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict | None:
        if self.num_top_logprobs is None:
            return None

        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        k = self.num_top_logprobs
        return {"content": [{**item(t, entry[t]), "top_logprobs": [item(i, lp) for i, lp in _by_logprob(entry)[:k]]}
                            for t, entry in zip(token_ids, entries)]}

    def opening_chunks(self) -> list[dict]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.choices))]

    def chunk(self, index: int, delta: CompletionOutput) -> dict:
        return self._chunk([{"index": index, "delta": {"content": delta.text} if delta.text else {},
                             "logprobs": self._logprobs(delta.token_ids, delta.logprobs or []),
                             "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}])

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}

    def response(self) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for i, c in enumerate(self.choices)]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


def _by_logprob(entry: dict[int, float]) -> list[tuple[int, float]]:
    """A token's logprob entry (its top k and the sampled token), most likely first."""
    return sorted(entry.items(), key=lambda item: -item[1])


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(stream: OutputStream, builder: _ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per choice delta, the usage chunk if asked, then `data: [DONE]`."""
    try:
        for chunk in builder.opening_chunks():
            yield _sse(chunk)
        async for output in stream:
            for index, delta in builder.add(output):
                if builder.worth_a_chunk(delta):
                    yield _sse(builder.chunk(index, delta))
        if include_usage:
            yield _sse(builder.usage_chunk())
    except Exception as e:  # the headers are sent: the error can only travel in the stream
        yield _sse(_as_api_error(e).body())
    yield "data: [DONE]\n\n"


class _EventStreamResponse(StreamingResponse):
    """SSE whose engine requests are aborted however the response ends: finished, failed, or the client gone
    (Starlette then cancels the body iterator)."""

    def __init__(self, events: AsyncIterator[str], stream: OutputStream):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, SamplingParamsError):
        return bad_request(str(e), e.field)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    return APIError(500, f"internal error: {e!r}", type="server_error")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, handler) -> Response:
    """Run the handler, cancelling it if the client disconnects first (as vLLM's `with_cancellation`): a
    cancelled handler closes its OutputStream, which aborts its engine requests."""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


# ====================================================================== the application

class OpenAIServer:
    """The HTTP handlers over one EngineLoop. Build the FastAPI app with `build_app`."""

    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name)
        self.engine_loop = EngineLoop(engine, self.metrics, config.log_interval_s)
        self.admission = AdmissionControl(config.max_waiting)
        # Read once here: afterwards only the engine thread touches the engine.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_root = engine.model.path

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI):
        self.engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.engine_loop.stop)

    # ------------------------------------------------------------ validation helpers

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.config.served_model_name}`).", param="model", code="model_not_found")

    def require_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", param)
        return self.tokenizer

    def completion_prompts(self, prompt) -> list[list[int]]:
        """A string, token ids, or a batch of either -> one list of token ids per prompt."""
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if not batch:
            raise bad_request("prompt must not be empty", "prompt")
        prompts = []
        for item in batch:
            if isinstance(item, str):
                if not item:
                    raise bad_request("prompt must not be empty", "prompt")
                item = self.require_tokenizer("prompt").encode(item)
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            prompts.append(list(item))
        return prompts

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: dict | None) -> str:
        tokenizer = self.require_tokenizer("messages")
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        template_kwargs = template_kwargs or {}
        reserved = sorted(RESERVED_TEMPLATE_ARGS & template_kwargs.keys())
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        messages = [m.for_template() for m in messages]
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 **template_kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # the template choked on what the client sent (a jinja error, a bad type)
            raise bad_request(f"the chat template cannot render these messages: {e!r}", "messages") from None

    def check_lengths(self, prompts: list[list[int]], max_tokens: int | None, n: int, prompt_param: str,
                      max_tokens_param: str) -> None:
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"n x prompts is {len(prompts) * n}; at most {MAX_CHOICES} choices per request", "n")
        for prompt in prompts:
            if len(prompt) + 1 > self.max_model_len:  # room for at least one generated token
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"your {prompt_param} has {len(prompt)} tokens, leaving no room to generate.",
                                  prompt_param)
            if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                                  f"{prompt_param}, {max_tokens} in the completion).", max_tokens_param)

    # ------------------------------------------------------------ submission

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     arrival_time: float, prompt_param: str) -> OutputStream:
        """Admit and queue the request; returns once the engine thread accepted it (a rejection is a 400)."""
        if not self.admission.admit(len(prompts)):
            raise APIError(503, f"The server is busy: {self.admission.num_waiting} requests are waiting "
                                f"(max_waiting={self.config.max_waiting}). Retry later.", type="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = OutputStream(ids, self.admission, self.engine_loop.abort)
        try:
            self.engine_loop.add(stream, prompts, params, arrival_time)
            await stream.accepted
        except BaseException as e:  # rejected, engine gone, or the client gone while we waited
            stream.close()
            if isinstance(e, Exception):
                error = _as_api_error(e)
                if error.param == "prompt":
                    error.param = prompt_param
                raise error from None
            raise
        return stream

    async def respond(self, stream: OutputStream, builder: _ResponseBuilder, streaming: bool,
                      include_usage: bool) -> Response:
        if streaming:
            return _EventStreamResponse(_events(stream, builder, include_usage), stream)
        try:
            async for output in stream:
                builder.add(output)
        finally:
            stream.close()
        return JSONResponse(builder.response())

    # ------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, self._completions(body))

    async def _completions(self, body: CompletionRequest) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        body.check_supported()
        params = body.sampling_params(body.max_tokens, body.logprobs, {})
        prompts = self.completion_prompts(body.prompt)
        self.check_lengths(prompts, body.max_tokens, params.n, "prompt", "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.submit(request_id, prompts, params, arrival, "prompt")
        builder = _CompletionBuilder(request_id, self.config.served_model_name, stream, params.n, prompts,
                                     self.tokenizer, params.logprobs)
        return await self.respond(stream, builder, body.stream, body.include_usage)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await _cancel_on_disconnect(request, self._chat_completions(body))

    async def _chat_completions(self, body: ChatCompletionRequest) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        max_tokens = body.output_token_limit
        params = body.sampling_params(max_tokens, body.logprobs_per_token,
                                      {"max_tokens": body.max_tokens_param, "logprobs": "top_logprobs"})
        text = self.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote its special tokens
        self.check_lengths([prompt], max_tokens, params.n, "messages", body.max_tokens_param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.submit(request_id, [prompt], params, arrival, "messages")
        builder = _ChatBuilder(request_id, self.config.served_model_name, stream, params.n, [prompt],
                               self.tokenizer, params.logprobs)
        return await self.respond(stream, builder, body.stream, body.include_usage)

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "ferry", "root": self.model_root, "max_model_len": self.max_model_len}]}

    async def health(self) -> Response:
        if not self.engine_loop.is_alive:
            return _as_api_error(EngineUnavailable("the engine is not running")).response()
        return Response(status_code=200)

    async def prometheus_metrics(self) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, media_type=content_type)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            text = self.render_chat(body.messages, body.add_generation_prompt, body.chat_template_kwargs)
            add_special_tokens = bool(body.add_special_tokens)  # default off: the template wrote them
        else:
            text = body.prompt
            add_special_tokens = body.add_special_tokens is not False
        tokens = self.require_tokenizer("prompt").encode(text, add_special_tokens=add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                "token_strs": token_strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        tokenizer = self.require_tokenizer("tokens")
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})",
                              "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}


class _ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but /health and /metrics. Plain ASGI (not
    BaseHTTPMiddleware) so streaming responses and disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                error = APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                 param=None, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`. Its lifespan starts and stops the engine thread, so run it under
    an ASGI server (uvicorn) that runs lifespans."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="Ferry", lifespan=server.lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), param=None, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("unhandled error")
        return _as_api_error(exc).response()

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus_metrics, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    if config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    return app
