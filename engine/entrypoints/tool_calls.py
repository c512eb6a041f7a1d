"""OpenAI tool calls from generated text.

Three modes, by the request's tool_choice:
  "named"     tool_choice names a function: the output is constrained to its parameters' schema, so the whole
              text is that call's `arguments` (streamed as argument deltas).
  "required"  the output is constrained to `forced_schema`: a JSON array of {"name", "parameters"} objects, one
              per call (sent whole when the output ends).
  "auto"      the model writes calls in its own format, read by one of TOOL_PARSERS (the server's
              --tool_call_parser, else `detect_tool_parser` on the chat template), as vLLM's parsers read them:
                hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere (Hermes, Qwen)
                llama3_json  the output is `{"name": ..., "parameters": {...}}` (or "arguments"), after an
                             optional `<|python_tag|>`, several separated by `;` (Llama 3.1+)
                mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
                             `[TOOL_CALLS]name[ARGS]{...}` (repeatable); text before `[TOOL_CALLS]` is content
              Whatever does not hold a call (bad JSON, an unclosed tag, a cut-short output) stays content, as
              the model wrote it. Streamed: content as it comes (a possible tag start held back), each call once
              complete.
"""

import abc
import dataclasses
import json
import re
import uuid

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
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


# ---------------------------------------------------------------------- helpers the "auto" parsers share


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (held back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_end(text: str) -> int | None:
    """Where the JSON object or array that `text` starts with ends (the index past its closing bracket), by
    counting brackets outside strings; None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _as_call(obj, name: str | None = None) -> ToolCall | None:
    """A call from a decoded {"name", "arguments" | "parameters"} object (or, given `name`, from the arguments
    alone); None if it is not one."""
    if name is None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name, obj = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if isinstance(obj, str):  # arguments already as JSON text
        return ToolCall(name, obj)
    if not isinstance(obj, dict):
        return None
    return ToolCall(name, json.dumps(obj, ensure_ascii=False))


_WAIT = object()  # a parser step's answer: the text so far cannot decide; wait for more


# ---------------------------------------------------------------------- the "auto" parsers


class ToolParser(abc.ABC):
    """One choice's "auto" output, fed text delta by text delta: `feed` returns (content delta, finished calls).
    Text is held in `pending` only while it could still become a call."""

    tags: tuple[str, ...] = ()        # the text must keep them (see `drops_tags`)

    def __init__(self):
        self.pending = ""

    @abc.abstractmethod
    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, finished calls) for the next delta of text."""


class HermesToolParser(ToolParser):
    tags = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.pending += text
        content, calls = "", []
        while True:
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if finished else partial_suffix(self.pending, TOOL_CALL_OPEN)
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
            call = _as_call(_loads(self.pending[start + len(TOOL_CALL_OPEN):end].strip()))
            close = end + len(TOOL_CALL_CLOSE)
            if call is None:
                content += self.pending[:close]
            else:
                content += self.pending[:start]
                calls.append(call)
            self.pending = self.pending[close:]


class _PrefixedCallsParser(ToolParser):
    """Calls that the output leads with or introduces with a marker, read one piece at a time by `_step` from
    `pending`: (content, calls, characters used), _WAIT, or None (not a call: from here on all is content)."""

    def __init__(self):
        super().__init__()
        self.state = "start"          # "start", "calls" (one was read), "content" (all the rest is content)

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.pending += text
        content, calls = "", []
        while self.pending and self.state != "content":
            step = self._step()
            if step is _WAIT and not finished:
                return content, calls
            if step is _WAIT and self.state == "calls" and not self.pending.strip():
                self.pending = ""     # blanks after the calls
                break
            if step is _WAIT or step is None:
                self.state = "content"
                break
            out, new_calls, used = step
            content, self.pending = content + out, self.pending[used:]
            if new_calls:
                calls += new_calls
                self.state = "calls"
        if self.state == "content":
            content, self.pending = content + self.pending, ""
        return content, calls

    @abc.abstractmethod
    def _step(self):
        """The next piece of `pending` (see the class)."""


def _json_call_at(text: str, at: int, name: str | None = None):
    """The call whose JSON object starts at text[at] (after blanks): ("", [call], index past it), _WAIT, or
    None. Given `name`, the object is the call's arguments."""
    body = text[at:].lstrip()
    at = len(text) - len(body)
    if not body:
        return _WAIT
    if body[0] != "{":
        return None
    end = _json_end(body)
    if end is None:
        return _WAIT
    call = _as_call(_loads(body[:end]), name)
    return None if call is None else ("", [call], at + end)


def _proper_prefix(text: str, tag: str) -> bool:
    """`text` may still become `tag` (blank included)."""
    return len(text) < len(tag) and tag.startswith(text)


class Llama3JsonToolParser(_PrefixedCallsParser):
    """The output is a call (after blanks and an optional <|python_tag|>), then `; call` as many times as it
    likes; anything else ends the calls (it and the rest are content)."""

    tags = (PYTHON_TAG,)

    def _step(self):
        head = self.pending.lstrip()
        at = len(self.pending) - len(head)
        if self.state == "start":
            if _proper_prefix(head, PYTHON_TAG):
                return _WAIT
            if head.startswith(PYTHON_TAG):
                at += len(PYTHON_TAG)
        elif not head:
            return _WAIT
        elif head.startswith(";"):
            at += 1
        else:
            return None
        return _json_call_at(self.pending, at)


class MistralToolParser(_PrefixedCallsParser):
    """Content until [TOOL_CALLS]; then a JSON array of calls, or `name[ARGS]{...}` (or `name{...}`), after
    which another [TOOL_CALLS] may follow. Anything else from a marker on is content."""

    tags = (MISTRAL_TOOL_CALLS, MISTRAL_ARGS)
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def _step(self):
        if self.state == "start":  # content before the first marker
            start = self.pending.find(MISTRAL_TOOL_CALLS)
            if start < 0:
                used = len(self.pending) - partial_suffix(self.pending, MISTRAL_TOOL_CALLS)
                return (self.pending[:used], [], used) if used else _WAIT
            if start > 0:
                return self.pending[:start], [], start
        head = self.pending.lstrip()
        if _proper_prefix(head, MISTRAL_TOOL_CALLS):
            return _WAIT  # blanks, or the start of the next marker
        if not head.startswith(MISTRAL_TOOL_CALLS):
            return None
        body = head[len(MISTRAL_TOOL_CALLS):].lstrip()
        at = len(self.pending) - len(body)
        if not body:
            return _WAIT
        if body[0] == "[":
            return self._array(body, at)
        name = self._NAME.match(body)
        if name is None:
            return None
        rest = body[name.end():]
        if not rest or _proper_prefix(rest, MISTRAL_ARGS):
            return _WAIT  # the name, or the [ARGS] after it, may go on
        at += name.end() + (len(MISTRAL_ARGS) if rest.startswith(MISTRAL_ARGS) else 0)
        return _json_call_at(self.pending, at, name.group())

    @staticmethod
    def _array(body: str, at: int):
        """The older format: a JSON array of {"name", "arguments"} objects, read once it closes."""
        end = _json_end(body)
        if end is None:
            return _WAIT
        items = _loads(body[:end])
        calls = [_as_call(item) for item in items] if isinstance(items, list) and items else [None]
        return None if None in calls else ("", calls, at + end)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
DEFAULT_TOOL_PARSER = "hermes"


def detect_tool_parser(chat_template: str | None) -> str:
    """The "auto" parser for a model whose chat template is `chat_template`, by what the template tells the model
    to write; hermes when it says nothing we know."""
    template = chat_template or ""
    if TOOL_CALL_OPEN in template:
        return "hermes"
    if MISTRAL_TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or '"parameters": dictionary' in template:  # Llama 3.1's JSON instructions
        return "llama3_json"
    return DEFAULT_TOOL_PARSER


def drops_tags(tokenizer, tags: tuple[str, ...]) -> bool:
    """Whether decoding with skip_special_tokens would drop any of `tags` (each a special token of this
    tokenizer): then the request must keep special tokens for its parser to see them, as vLLM's mistral parser
    does (`skip_special_tokens = False`)."""
    if tokenizer is None:
        return False
    return any(tokenizer.decode(tokenizer.encode(tag, add_special_tokens=False), skip_special_tokens=True) != tag
               for tag in tags)


def parse_tool_calls(text: str, parser: str = DEFAULT_TOOL_PARSER) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole "auto" output."""
    return TOOL_PARSERS[parser]().feed(text, finished=True)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    return parse_tool_calls(text, "hermes")


class ToolCallStream:
    """One choice's output, fed text delta by text delta: returns (content delta, finished calls) each time."""

    def __init__(self, mode: str, name: str | None = None, parser: str = DEFAULT_TOOL_PARSER):
        self.mode = mode                              # one of TOOL_MODES
        self.name = name                              # the named function ("named" mode)
        self.pending = ""                             # "required": the array so far
        self.named_call: ToolCall | None = None       # "named": the call whose arguments are streaming
        self.auto = TOOL_PARSERS[parser]() if mode == "auto" else None

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if self.mode == "named":
            return "", self._feed_named(text)
        if self.mode == "auto":
            return self.auto.feed(text, finished)
        self.pending += text
        if not finished:
            return "", []
        calls, self.pending = parse_required(self.pending), ""
        return "", calls

    def _feed_named(self, text: str) -> list[ToolCall]:
        """The first delta opens the call (id, name); later ones carry argument text only (id "")."""
        if self.named_call is None:
            self.named_call = ToolCall(self.name, text)
            return [self.named_call]
        return [ToolCall(self.name, text, id="")] if text else []
