"""OpenAI response shapes: engine deltas folded into choices, streamed as server-sent events or returned whole."""

import abc
import base64
import dataclasses
import json
import time
from collections.abc import AsyncIterator

import numpy as np
from fastapi.responses import StreamingResponse

from engine.entrypoints.api_protocol import as_api_error
from engine.entrypoints.engine_loop import OutputStream
from engine.entrypoints.reasoning import REASONING_PARSERS
from engine.entrypoints.tool_calls import DEFAULT_TOOL_PARSER, ToolCallStream, parse_required, parse_tool_calls
from engine.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass(slots=True)
class _ChoiceState:
    """One choice's output so far."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0               # completions' logprobs.text_offset of the next streamed token
    tool_calls_sent: int = 0           # chat: streamed tool calls so far (the next one's index)


class ResponseBuilder(abc.ABC):
    """Turns one API request's engine deltas into OpenAI choices: streamed chunks as they come, or the
    whole response at the end. Choice i*n + j is sample j of prompt i. Subclasses give the shapes."""

    def __init__(self, request_id: str, model: str, stream: OutputStream, n: int, prompts: list[list[int]],
                 tokenizer, num_top_logprobs: int | None):
        self.id, self.model, self.n, self.created = request_id, model, n, int(time.time())
        self.tokenizer, self.num_top_logprobs = tokenizer, num_top_logprobs
        self._prompt_index = {request_id: i for i, request_id in enumerate(stream.request_ids)}
        self.choices = [_ChoiceState() for _ in range(len(prompts) * n)]
        self.prompts = prompts
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
    """`echo`: each prompt's text, put before its choices' text (with logprobs: its tokens and their logprobs
    too, the first token's null), as vLLM and lm-evaluation-harness's scoring read it. `echo_only` (max_tokens
    0): the prompt alone; the one token the engine generated is left out."""

    def __init__(self, *args, echo: list[str] | None = None, echo_only: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo, self.echo_only = echo, echo_only
        self._prompt_logprobs: list[list | None] = [None] * len(self.prompts)
        self._echoed = [False] * len(self.choices)  # streamed: the choice's first chunk carried the prompt

    def add(self, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[self._prompt_index[output.request_id]] = output.prompt_logprobs
        if self.echo_only:
            output = dataclasses.replace(output, outputs=[CompletionOutput(
                d.index, "", [], "length" if d.finish_reason is not None else None, [] if d.logprobs is not None
                else None) for d in output.outputs])
        return super().add(output)

    def _header(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None], text_offset: int) -> dict | None:
        if self.num_top_logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        # As vLLM: each position's top_logprobs holds the top k and the sampled (or prompt) token; a position
        # nothing predicts (the prompt's first token) is null.
        return {"tokens": tokens,
                "token_logprobs": [None if entry is None else entry[t] for t, entry in zip(token_ids, entries)],
                "top_logprobs": [None if entry is None else {self.token_text(t): lp for t, lp in _by_logprob(entry)}
                                 for entry in entries],
                "text_offset": offsets}

    def _echoed_prompt(self, index: int) -> tuple[str, dict | None]:
        """The prompt of choice `index`: its text and, with logprobs, its tokens' logprobs (from offset 0)."""
        prompt = index // self.n
        ids = self.prompts[prompt]
        entries = list(self._prompt_logprobs[prompt] or [])[:len(ids)]
        return self.echo[prompt], self._logprobs(ids, entries + [None] * (len(ids) - len(entries)), 0)

    def _with_echo(self, index: int, text: str, token_ids: list[int], entries: list, text_offset: int):
        """(text, logprobs) of a choice's output, after its echoed prompt when `echo`."""
        if self.echo is None:
            return text, self._logprobs(token_ids, entries, text_offset)
        prompt_text, prompt_logprobs = self._echoed_prompt(index)
        logprobs = self._logprobs(token_ids, entries, text_offset + len(prompt_text))
        if logprobs is not None:
            logprobs = {key: prompt_logprobs[key] + logprobs[key] for key in logprobs}
        return prompt_text + text, logprobs

    @staticmethod
    def _choice(index: int, text: str, logprobs: dict | None, c: _ChoiceState | CompletionOutput) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def worth_a_chunk(self, delta: CompletionOutput) -> bool:
        return super().worth_a_chunk(delta) or self.echo is not None

    def chunk(self, index: int, delta: CompletionOutput) -> dict:
        choice = self.choices[index]
        if self.echo is not None and not self._echoed[index]:  # the choice's first chunk: the prompt first
            self._echoed[index] = True
            text, logprobs = self._with_echo(index, delta.text, delta.token_ids, delta.logprobs or [],
                                             choice.text_offset)
            choice.text_offset += len(text) - len(delta.text)
        else:
            text, logprobs = delta.text, self._logprobs(delta.token_ids, delta.logprobs or [], choice.text_offset)
        if logprobs is not None:
            choice.text_offset += sum(len(self.token_text(t)) for t in delta.token_ids)
        return {**self._header(), "choices": [self._choice(index, text, logprobs, delta)]}

    def usage_chunk(self) -> dict:
        return {**self._header(), "choices": [], "usage": self.usage()}

    def response(self) -> dict:
        choices = [self._choice(i, *self._with_echo(i, c.text, c.token_ids, c.logprobs, 0), c)
                   for i, c in enumerate(self.choices)]
        return {**self._header(), "choices": choices, "usage": self.usage()}


class ChatBuilder(ResponseBuilder):
    """`tool_mode` (engine/entrypoints/tool_calls.py): None, or how the choices' text becomes tool_calls, with
    `tool_parser` reading "auto" calls. `reasoning_parser` (engine/entrypoints/reasoning.py): None, or how the
    reasoning is split off into reasoning_content first; tool calls are read from the content part only."""

    def __init__(self, *args, tool_mode: str | None = None, tool_name: str | None = None,
                 tool_parser: str = DEFAULT_TOOL_PARSER, reasoning_parser: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_mode, self.tool_name, self.tool_parser = tool_mode, tool_name, tool_parser
        # A forced call's output is the call's JSON alone (its grammar leaves no room to think).
        self.reasoning_parser = None if tool_mode in ("named", "required") else reasoning_parser
        self._tool_streams = ([ToolCallStream(tool_mode, tool_name, tool_parser) for _ in self.choices]
                              if tool_mode else None)
        self._reasoning_streams = ([REASONING_PARSERS[self.reasoning_parser]() for _ in self.choices]
                                   if self.reasoning_parser else None)

    def _finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        # As OpenAI: a model that called tools (by its choice, or required to) ends with "tool_calls"; a call
        # forced by name ends with "stop".
        if finish_reason == "stop" and called and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def _message(self, text: str) -> tuple[dict, bool]:
        """The whole response's message for a choice's text, and whether it holds tool calls."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = REASONING_PARSERS[self.reasoning_parser]().feed(text, finished=True)
        if self.tool_mode is None:
            content, calls = text, []
        elif self.tool_mode == "named":
            content, calls = None, [ToolCallStream("named", self.tool_name).feed(text, True)[1][0]]
        elif self.tool_mode == "required":
            content, calls = None, parse_required(text)
        else:
            content, calls = parse_tool_calls(text, self.tool_parser)
            content = content if content.strip() or not calls else None
        message = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:  # as vLLM: None for no reasoning, and for no content after it
            message["content"], message["reasoning_content"] = content or None, reasoning or None
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return message, bool(calls)

    def _delta(self, index: int, delta: CompletionOutput) -> tuple[dict, bool]:
        """A streamed chunk's delta for a choice, and whether the choice has made a tool call so far."""
        text, finished, out = delta.text, delta.finish_reason is not None, {}
        if self._reasoning_streams is not None:
            reasoning, text = self._reasoning_streams[index].feed(text, finished)
            if reasoning:
                out["reasoning_content"] = reasoning
        if self._tool_streams is None:
            return out | ({"content": text} if text else {}), False
        stream, choice = self._tool_streams[index], self.choices[index]
        content, calls = stream.feed(text, finished)
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [_call_delta(call, choice.tool_calls_sent + i, stream.mode) for i,
                                 call in enumerate(calls)]
            if stream.mode != "named":
                choice.tool_calls_sent += len(calls)
        return out, stream.named_call is not None or choice.tool_calls_sent > 0

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
        message_delta, called = self._delta(index, delta)
        return self._chunk([{"index": index, "delta": message_delta,
                             "logprobs": self._logprobs(delta.token_ids, delta.logprobs or []),
                             "finish_reason": self._finish_reason(delta.finish_reason, called),
                             "stop_reason": delta.stop_reason}])

    def usage_chunk(self) -> dict:
        return {**self._chunk([]), "usage": self.usage()}

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            message, called = self._message(c.text)
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": self._finish_reason(c.finish_reason, called),
                            "stop_reason": c.stop_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


def _call_delta(call, index: int, mode: str) -> dict:
    """A streamed tool_calls entry: the first of a call carries id, type and name; a named call's later
    deltas carry only argument text (OpenAI's shape)."""
    if mode == "named" and not call.id:
        return {"index": 0, "function": {"arguments": call.arguments}}
    return call.as_dict(index)


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


def embedding_response(model: str, embeddings: list[list[float]], prompt_tokens: int, encoding_format: str) -> dict:
    """OpenAI's embeddings response: input i's vector as a list of floats, or ("base64", what the openai client
    asks for by default) its little-endian float32 bytes in base64."""
    def encode(embedding: list[float]):
        if encoding_format == "base64":
            return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
        return embedding

    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode(e)} for i, e in enumerate(embeddings)],
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
