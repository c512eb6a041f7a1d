"""The engine thread behind the server: a command queue in, per-request output streams out.

The engine core is touched by exactly one thread, the engine loop (`EngineLoop`). HTTP handlers run on the
asyncio event loop and talk to it through a thread-safe command queue (add, abort), applied at the top of
every loop iteration, so an abort frees its blocks before the next step. When idle the engine thread blocks
on that queue (no busy spin). Each step's news (token ids, finishes) goes to a second thread, the output
thread, which detokenizes, matches stop strings and builds the deltas (engine/output_processor.py) while the
engine thread runs the next step; a stop string it finds ends its request before the core's next schedule.
At most two steps' news wait for it, so text never lags far behind. Each API request gets an `OutputStream`:
an asyncio.Queue the output thread fills with a step's deltas through one `call_soon_threadsafe` per step, so
a step never waits on the event loop and the event loop never waits on a step.

Faults: a request that fails inside a step ends alone (its stream raises RequestFailed, a 500); a fault the
engine cannot isolate (EngineDeadError, or a bug in this loop) fails every stream with EngineUnavailable and
calls `on_fatal`, so the server exits non-zero for its supervisor to restart it.
"""

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from engine.entrypoints.api_protocol import EngineUnavailable, RequestFailed
from engine.entrypoints.metrics import ServerMetrics
from engine.llm_engine import LLMEngine
from engine.outputs import EmbeddingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

log = logging.getLogger("ferry.server")


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
        self.on_close: Callable[["OutputStream"], None] | None = None  # e.g. the server's open-stream count

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
        if self.on_close is not None:
            self.on_close(self)
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
    params: SamplingParams | PoolingParams  # PoolingParams: embedding requests (/v1/embeddings)
    arrival_time: float            # time.monotonic() when the server received the API request
    cache_salt: str | None = None  # prefix-cache namespace (kv_cache_manager)


@dataclasses.dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread; its result (or error) settles `future` on `loop`."""
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclasses.dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass(slots=True)
class _Stop:
    pass


@dataclasses.dataclass(slots=True)
class _Fatal:
    """The output thread failed: the engine thread raises it, ending the loop as any fatal fault does."""
    error: BaseException


@dataclasses.dataclass(slots=True)
class _Tracked:
    """The loop's record of one engine request, for routing its deltas and for metrics (added by the engine
    thread, updated and dropped by the output thread, or dropped by the engine thread on abort)."""

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

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, log_interval_s: float = 5.0,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.error: BaseException | None = None  # set if the loop died
        self._on_fatal = on_fatal  # called on the engine thread once the loop died and every reader heard
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards _accepting: once the loop stops, no add may slip into the queue after its final drain.
        self._lock = threading.Lock()
        self._accepting = True
        self._refusal = "the engine is not running"
        self._tracked: dict[str, _Tracked] = {}
        self._throughput = _ThroughputLog(log_interval_s)
        self._thread = threading.Thread(target=self._run, name="ferry-engine-loop", daemon=True)
        # (step start, StepNews) to the output thread, None to end it; bounded, so text lags two steps at most
        self._news: queue.Queue = queue.Queue(maxsize=2)
        self._output_thread = threading.Thread(target=self._run_outputs, name="ferry-outputs", daemon=True)

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._output_thread.start()
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight (its readers get EngineUnavailable) and end the thread."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._accepting and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """API-side engine requests not yet finished (read from any thread: a dict's len is atomic)."""
        return len(self._tracked) + self._commands.qsize()

    def stop_accepting(self, reason: str) -> None:
        """Drain: new adds fail with EngineUnavailable(reason) (a 503); what runs goes on."""
        with self._lock:
            self._accepting = False
            self._refusal = reason

    def add(self, stream: OutputStream, prompts: list[list[int]], params: SamplingParams | PoolingParams,
            arrival_time: float, cache_salt: str | None = None) -> None:
        with self._lock:
            if not self._accepting:
                raise EngineUnavailable(self._refusal)
            self._commands.put(_Add(stream, prompts, params, arrival_time, cache_salt))

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine) on the engine thread (the only one that may touch the engine), awaited here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if not self._accepting:
                raise EngineUnavailable(self._refusal)
            self._commands.put(_Call(fn, future, loop))
        return await future

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(request_ids))

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:  # the engine cannot go on: fail every reader rather than hang it
            log.exception("the engine loop died")
            self.error = e
            self._stop_outputs()
            self._fail_all(EngineUnavailable(f"the engine failed: {e!r}"))
            if self._on_fatal is not None:
                self._on_fatal(e)

    def _iterate(self) -> bool:
        """One loop iteration: commands, then a step if there is work. False once stopped."""
        busy = self.engine.has_unfinished()
        for command in self._take_commands(block=not busy):
            if isinstance(command, _Stop):
                self._stop_outputs()
                self._fail_all(EngineUnavailable("the server is shutting down"))
                return False
            if isinstance(command, _Fatal):
                raise command.error
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self._abort(command.request_ids)
        if self.engine.has_unfinished():
            self._step()
        stats = self.engine.stats()
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
                self.engine.add_request(request_id, prompt, params, cache_salt=command.cache_salt)
                added.append(request_id)
        except Exception as e:  # all or nothing: a rejected prompt takes its siblings with it
            for request_id in added:
                self.engine.abort(request_id)
            _call_soon(stream.loop, stream.settle, e)
            return
        for request_id, prompt in zip(stream.request_ids, command.prompts):
            self._tracked[request_id] = _Tracked(stream, command.arrival_time, len(prompt),
                                                 params.n if isinstance(params, SamplingParams) else 1)
        _call_soon(stream.loop, stream.settle, None)

    def _call(self, command: _Call) -> None:
        def settle(result, error):
            if not command.future.done():
                command.future.set_exception(error) if error is not None else command.future.set_result(result)

        try:
            result, error = command.fn(self.engine), None
        except Exception as e:
            result, error = None, e
        _call_soon(command.loop, settle, result, error)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if not self.engine.abort(request_id):
                # It finished in the core already (its client hung up meanwhile): the output thread records
                # that finish and stops tracking it, as for any request, so each sample counts once.
                continue
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                for _ in range(tracked.num_samples - tracked.num_finished_samples):
                    self.metrics.record_finished_sample("abort")

    def _step(self) -> None:
        step_start = time.monotonic()
        self._put_news((step_start, self.engine.step_core()))

    def _put_news(self, item) -> None:
        """Hand an item to the output thread, waiting while it is two steps behind (never on a dead one)."""
        while True:
            try:
                self._news.put(item, timeout=1.0)
                return
            except queue.Full:
                if not self._output_thread.is_alive():
                    raise RuntimeError("the output thread died") from None

    def _stop_outputs(self) -> None:
        """End the output thread after the news already queued (called on the engine thread)."""
        if self._output_thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._put_news(None)
            self._output_thread.join(30.0)

    # ------------------------------------------------------------ output thread

    def _run_outputs(self) -> None:
        while (item := self._news.get()) is not None:
            try:
                self._deliver_step(*item)
            except BaseException as e:  # a bug on the output side: the loop cannot serve correct text
                log.exception("the output thread died")
                self._commands.put(_Fatal(e))
                return

    def _deliver_step(self, step_start: float, news) -> None:
        outputs = self.engine.process_outputs(news)
        now = time.monotonic()
        self._note_first_scheduled(step_start, news)
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            self._record(output, tracked, step_start, now)
            item = output if output.error is None else RequestFailed(output.error)
            deliveries.setdefault(tracked.stream.loop, []).append((tracked.stream, item))
        for loop, items in deliveries.items():  # one wake-up of the event loop per step, not per request
            _call_soon(loop, _deliver, items)

    def _note_first_scheduled(self, step_start: float, news) -> None:
        """Queue time ends when the scheduler first admits a request; the step's trace names who it admitted
        (sample ids `<request id>#<sample>`)."""
        for phase, info in self.engine.step_trace(news):
            if phase != "admit":
                continue
            for sample_id in list(info.get("admitted", ())) + list(info.get("pending", ())):
                tracked = self._tracked.get(sample_id.rpartition("#")[0])
                if tracked is not None and not tracked.scheduled:
                    tracked.scheduled = True
                    self.metrics.request_queue_time.observe(step_start - tracked.arrival_time)

    def _record(self, output: RequestOutput, tracked: _Tracked, step_start: float, now: float) -> None:
        m = self.metrics
        if isinstance(output, EmbeddingRequestOutput):  # one output: its prompt is processed and it is done
            m.prompt_tokens.inc(tracked.num_prompt_tokens)
            self._throughput.add(tracked.num_prompt_tokens, 0)
            m.record_finished_sample("error" if output.error is not None else "stop")
            m.e2e_request_latency.observe(now - tracked.arrival_time)
            self._tracked.pop(output.request_id, None)
            return
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
            self._tracked.pop(output.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        """Stop accepting, abort everything, and hand `error` to every reader and every waiting handler."""
        with self._lock:
            self._accepting = False
            self._refusal = str(error)
        for request_id in list(self._tracked):
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:  # the output thread finished it meanwhile
                continue
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
            elif isinstance(command, _Call):
                _call_soon(command.loop, command.future.set_exception, error)


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
                     "host KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%", self._prompt_tokens / elapsed,
                     self._generation_tokens / elapsed, stats["num_running"], stats["num_swapped"],
                     stats["num_waiting"], 100 * stats["kv_usage"], 100 * stats.get("host_usage", 0.0),
                     100 * stats.get("prefix_cache_hit_rate", 0.0))
        self._was_active = active
        self._last_log, self._prompt_tokens, self._generation_tokens = now, 0, 0
