"""OpenAI tool calls from generated text.

Three modes, by the request's tool_choice:
  "named"     tool_choice names a function: the output is constrained to its parameters' schema, so the whole
              text is that call's `arguments` (streamed as argument deltas).
  "required"  the output is constrained to `forced_schema`: a JSON array of {"name", "parameters"} objects, one
              per call (sent whole when the output ends).
  "auto"      the model writes Hermes/Qwen-style calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
              anywhere in its text; the rest is content. Streamed: content as it comes (a possible tag start
              held back), each call once its closing tag arrives.
"""

import dataclasses
import json
import uuid

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_MODES = ("named", "required", "auto")


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                      # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=_call_id)

    def as_dict(self, index: int | None = None) -> dict:
        """The message's tool_calls entry (with `index`: a streamed delta's)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def function_parameters(tool: dict) -> dict:
    """A tool's parameter schema; a function without one takes an empty object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_schema(tools: list[dict], parallel: bool = True) -> dict:
    """tool_choice="required": one call (or, `parallel`, one or more), each naming a tool and giving arguments
    of its schema."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": function_parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a "required" output (an array per forced_schema); [] if it is not one (cut short)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def _hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an "auto" output. A tag that does not hold a call (bad JSON, no closing tag)
    stays in the content, as the model wrote it."""
    stream = ToolCallStream("auto")
    content, calls = stream.feed(text, finished=True)
    return content, calls


@dataclasses.dataclass(slots=True)
class ToolCallStream:
    """One choice's output, fed text delta by text delta: returns (content delta, finished calls) each time."""

    mode: str                           # one of TOOL_MODES
    name: str | None = None             # the named function ("named" mode)
    pending: str = ""                   # text held back: a possible tag start, an open call, a "required" array
    named_call: ToolCall | None = None  # "named": the call whose arguments are streaming

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if self.mode == "named":
            return "", self._feed_named(text)
        self.pending += text
        if self.mode == "required":
            if not finished:
                return "", []
            calls, self.pending = parse_required(self.pending), ""
            return "", calls
        return self._feed_auto(finished)

    def _feed_named(self, text: str) -> list[ToolCall]:
        """The first delta opens the call (id, name); later ones carry argument text only (id "")."""
        if self.named_call is None:
            self.named_call = ToolCall(self.name, text)
            return [self.named_call]
        return [ToolCall(self.name, text, id="")] if text else []

    def _feed_auto(self, finished: bool) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if finished else _partial_suffix(self.pending, TOOL_CALL_OPEN)
                content += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return content, calls
            end = self.pending.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                content += self.pending[:start]
                self.pending = self.pending[start:]
                if finished:  # an unclosed tag: the model's text, as it wrote it
                    content, self.pending = content + self.pending, ""
                return content, calls
            call = _hermes_call(self.pending[start + len(TOOL_CALL_OPEN):end].strip())
            close = end + len(TOOL_CALL_CLOSE)
            if call is None:
                content += self.pending[:close]
            else:
                content += self.pending[:start]
                calls.append(call)
            self.pending = self.pending[close:]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (held back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
