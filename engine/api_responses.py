"""OpenAI response shapes: engine deltas folded into choices, streamed as server-sent events or returned whole."""

import abc
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from engine.api_protocol import as_api_error
from engine.engine import CompletionOutput, RequestOutput
from engine.engine_loop import OutputStream


@dataclasses.dataclass(slots=True)
class _ChoiceState:
    """One choice's output so far."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0               # completions' logprobs.text_offset of the next streamed token


class ResponseBuilder(abc.ABC):
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


class CompletionBuilder(ResponseBuilder):
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


class ChatBuilder(ResponseBuilder):
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


async def sse_events(stream: OutputStream, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
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
        yield _sse(as_api_error(e).body())
    yield "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
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
