"""The output side of a step: detokenizing, stop strings, logprob dicts, and the RequestOutputs users see.

The engine core (`LLMEngine.step_core`) advances requests by token ids only and reports each step as a
`StepNews` snapshot: plain values, no live Request. Everything text-shaped happens here, on those snapshots,
so it can run on another thread (the server's output thread, engine/entrypoints/engine_loop.py) while the core plans
and runs the next step: the core never waits on text. `LLMEngine.step()` runs both, one after the other.

A stop string is found here, after the core has moved on: the sample ends at once in its outputs (its
text and token ids stop at the token that completed the stop string), and the core is told through
`finishes` to end the request, which it does before its next schedule, a step later at most (tokens the
core made meanwhile are dropped here). Work is O(requests with news), never O(all requests).
"""

import dataclasses
import itertools
import queue
import time
from collections.abc import Iterator

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from engine.sampling_params import SamplingParams
from models.tokenizers.tokenizer import Tokenizer

# ------------------------------------------------------------------ core -> output side

# What one sample gained in a step: (request_id: the user request, the group of n samples; index: which of its
# samples; token_id: the output token it gained; logprob: (logprob of token_id, [(id, logprob), ...] top-k) when
# it asks for logprobs, else None; finish_reason: the core's finish, "stop" (EOS, stop id, grammar) or "length",
# else None). A plain tuple: the core builds one per running request per step, and a class's constructor
# costs several times a tuple's.
SampleNews = tuple[str, int, int, tuple | None, str | None]


@dataclasses.dataclass(slots=True)
class StepNews:
    samples: list[SampleNews]              # every sample that gained a token, in step order, but `decoded`'s
    prompt_logprobs: dict[str, tuple]      # request id -> this step's scored prompt rows (ModelRunnerOutput's)
    errors: dict[str, str]                 # request id -> why the core failed it (every sample ends "error")
    trace: list                            # the scheduler's decisions this step: [(phase, info), ...]
    finished_at: float                     # time.monotonic() when the core step ended
    # The decode batch's samples (after `samples`) as SampleNews' five fields in columns, each [batch], when the
    # core built no tuple per sample (LLMEngine._sample_news); () when it did. Never changed once handed over.
    decoded: tuple = ()
    embeddings: dict = dataclasses.field(default_factory=dict)  # request id -> float32 embedding, finished now

    def all_samples(self) -> Iterator[SampleNews]:
        return itertools.chain(self.samples, zip(*self.decoded))


# ------------------------------------------------------------------ output state

@dataclasses.dataclass(slots=True)
class _SampleOutput:
    """One of a request's n samples as the user sees it."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    stops: tuple[str, ...]                 # stop strings, armed once min_tokens tokens are out
    min_tokens: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    emitted_tokens: int = 0                # output tokens already returned in a delta
    emitted_text: int = 0                  # characters of text already returned in a delta


@dataclasses.dataclass(slots=True)
class OutputGroup:
    """A user request (n samples of one prompt) as the user sees it. Made by the core's add_request, then
    touched only by the output side."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stop_token_ids: tuple[int, ...]
    samples: list[_SampleOutput]
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False     # a delta carried them (the first: the prompt is scored by then)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None               # the request failed: every sample ended with "error"
    final_only: bool = False               # no delta until finished (LLMEngine.add_request)

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        for sample in self.samples:  # a loop, not all(genexpr): asked per request per step, mostly n == 1
            if sample.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.groups: dict[str, OutputGroup] = {}  # unfinished requests (a dict op is atomic across threads)
        # To the core: ("stop", request id, sample index) a stop string ended a sample; ("error", request id,
        # message) its text failed. Thread-safe: the core drains it before each schedule.
        self.finishes: queue.SimpleQueue = queue.SimpleQueue()
        self.pooling: dict[str, list[int]] = {}  # unfinished embedding requests: their prompt token ids

    def register(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 stop_token_ids: tuple[int, ...], final_only: bool = False) -> OutputGroup:
        samples = [_SampleOutput(i, self._detokenizer(prompt_ids, params), tuple(params.stop), params.min_tokens,
                                 logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        group = OutputGroup(request_id, prompt, list(prompt_ids), stop_token_ids, samples,
                            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                            arrival_time=time.monotonic(), final_only=final_only)
        self.groups[request_id] = group
        return group

    def register_pooling(self, request_id: str, prompt_ids: list[int]) -> None:
        """An embedding request: no text, one output when it finishes (StepNews.embeddings)."""
        self.pooling[request_id] = list(prompt_ids)

    def forget(self, request_id: str) -> None:
        """The request was aborted: no more outputs for it."""
        self.groups.pop(request_id, None)
        self.pooling.pop(request_id, None)

    def _detokenizer(self, prompt_ids, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        # Stop strings join once min_tokens are out (_advance), as vLLM checks them.
        stops = tuple(params.stop) if params.min_tokens == 0 else ()
        return IncrementalDetokenizer(self.tokenizer, list(prompt_ids), params.skip_special_tokens,
                                      stops, params.include_stop_str_in_output)

    # -------------------------------------------------------------- a step's news

    def process(self, news: StepNews) -> list[RequestOutput]:
        """Fold a step's news into the requests' text; a delta for every request that changed."""
        changed: dict[str, list[_SampleOutput]] = {}
        for request_id, error in news.errors.items():
            if (group := self.groups.get(request_id)) is not None:
                self._fail(group, error)
                changed[request_id] = group.samples
        for request_id, scores in news.prompt_logprobs.items():
            if (group := self.groups.get(request_id)) is not None:
                self._record_prompt_logprobs(group, scores)
        for request_id, index, token_id, logprob, finish_reason in news.all_samples():
            group = self.groups.get(request_id)
            if group is None or group.error is not None:  # aborted, failed, or ended here already
                continue
            sample = group.samples[index]
            try:
                if self._advance(group, sample, token_id, logprob, finish_reason):
                    changed.setdefault(group.request_id, []).append(sample)
            except Exception as e:  # this sample's text failed (its detokenizer): the request ends, alone
                self._fail(group, f"RuntimeError: {type(e).__name__}: {e}")
                self.finishes.put(("error", group.request_id, group.error))
                changed[group.request_id] = group.samples
        deltas = []
        for request_id, samples in changed.items():
            group = self.groups[request_id]
            if group.first_token_time is None:
                group.first_token_time = news.finished_at
            finished = group.finished
            if finished:
                group.finished_time = news.finished_at
                del self.groups[request_id]
            elif group.final_only:
                continue
            # A final-only request's one delta holds every sample's whole output.
            deltas.append(self.render(group, group.samples if group.final_only else samples, delta=True,
                                      finished=finished))
        if news.embeddings or (news.errors and self.pooling):
            deltas += self._embedding_outputs(news)
        return deltas

    def _embedding_outputs(self, news: StepNews) -> list[EmbeddingRequestOutput]:
        """The embedding requests that finished (or failed) in this step: one final output each."""
        outputs = []
        for request_id, embedding in news.embeddings.items():
            if (prompt_ids := self.pooling.pop(request_id, None)) is not None:
                outputs.append(EmbeddingRequestOutput(request_id, EmbeddingOutput(embedding.tolist()), prompt_ids))
        for request_id, error in news.errors.items():
            if (prompt_ids := self.pooling.pop(request_id, None)) is not None:
                outputs.append(EmbeddingRequestOutput(request_id, EmbeddingOutput([]), prompt_ids, error=error))
        return outputs

    @staticmethod
    def _record_prompt_logprobs(group: OutputGroup, scored: tuple) -> None:
        """Each scored row at its prompt position: a position scored again (a recompute-preempted prefill
        runs its chunks again) is written again, with the same values."""
        if group.prompt_logprobs is None:
            return
        first, scores = scored
        ids, entries = group.prompt_token_ids, group.prompt_logprobs
        for position, (logprob, top) in enumerate(scores, first):
            entry = dict(top)
            entry[ids[position]] = logprob
            if position < len(entries):
                entries[position] = entry
            else:
                entries.append(entry)

    def _advance(self, group: OutputGroup, sample: _SampleOutput, token_id: int, logprob: tuple | None,
                 finish_reason: str | None) -> bool:
        """Fold one sample's news (a SampleNews' fields) in; True if there is something new to report."""
        if sample.finish_reason is not None:  # ended here already: what the core made since is dropped
            return False
        detokenizer = sample.detokenizer
        sample.token_ids.append(token_id)
        if sample.logprobs is not None and logprob is not None:
            token_logprob, top = logprob
            entry = dict(top)
            entry[token_id] = token_logprob
            sample.logprobs.append(entry)
        if detokenizer is not None:
            if sample.stops and not detokenizer.stop and len(sample.token_ids) >= sample.min_tokens:
                detokenizer.stop = sample.stops
            # As vLLM: the EOS or stop token that ended the sample is in its token ids, not its text (which would
            # show it with skip_special_tokens=False, e.g. "</s>" after a tool call) unless asked for
            ended_by_token = finish_reason == "stop" and (token_id in self.eos_token_ids
                                                          or token_id in group.stop_token_ids)
            if not ended_by_token or detokenizer.include_stop_str_in_output:
                sample.text += detokenizer.add_token(token_id)
            if detokenizer.stopped_by is not None:
                sample.finish_reason = "stop"
                if finish_reason is None:  # the core still runs it: tell it to stop
                    self.finishes.put(("stop", group.request_id, sample.index))
        if sample.finish_reason is None:
            sample.finish_reason = finish_reason
        if sample.finish_reason is not None and detokenizer is not None:
            sample.text += detokenizer.flush()  # held-back text; "" once already flushed
        return True

    @staticmethod
    def _fail(group: OutputGroup, error: str) -> None:
        group.error = error
        for sample in group.samples:
            sample.finish_reason = "error"

    # -------------------------------------------------------------- rendering

    def render(self, group: OutputGroup, samples, delta: bool, finished: bool | None = None) -> RequestOutput:
        outputs = []
        for sample in samples:  # per request with news per step: positional arguments, locals
            start_tok, start_txt = (sample.emitted_tokens, sample.emitted_text) if delta else (0, 0)
            token_ids, text, logprobs = sample.token_ids, sample.text, sample.logprobs
            finish_reason = sample.finish_reason
            outputs.append(CompletionOutput(
                sample.index, text[start_txt:], token_ids[start_tok:], finish_reason,
                None if logprobs is None else logprobs[start_tok:],
                None if finish_reason is None else _stop_reason(group, sample)))
            if delta:
                sample.emitted_tokens, sample.emitted_text = len(token_ids), len(text)
        finished = group.finished if finished is None else finished
        metrics = {"arrival_time": group.arrival_time, "first_token_time": group.first_token_time,
                   "finished_time": group.finished_time}
        # As vLLM: in deltas, the prompt's logprobs come once, with the first token (its prefill scored them).
        prompt_logprobs = group.prompt_logprobs if not (delta and group.prompt_logprobs_sent) else None
        group.prompt_logprobs_sent |= delta
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             prompt_logprobs, metrics, error=group.error)


def _stop_reason(group: OutputGroup, sample: _SampleOutput):
    """The stop string or stop token id that ended a sample with "stop" (None for EOS or a grammar's end)."""
    if sample.finish_reason != "stop":
        return None
    if sample.detokenizer is not None and sample.detokenizer.stopped_by is not None:
        return sample.detokenizer.stopped_by
    last = sample.token_ids[-1] if sample.token_ids else None
    return last if last in group.stop_token_ids else None
