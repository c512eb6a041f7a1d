"""The chat output parsers without a server: each reasoning parser (engine/entrypoints/reasoning.py) and each
"auto" tool-call parser (engine/entrypoints/tool_calls.py), parsed whole and streamed. A stream split at any
character boundary (one character per delta, and every split in two) must join to the whole parse; malformed
input (bad JSON, unclosed tags, a cut-short output) stays content as the model wrote it."""

import json
import types

import pytest

from engine.entrypoints.api_responses import ChatBuilder
from engine.entrypoints.reasoning import REASONING_PARSERS, parse_reasoning
from engine.entrypoints.tool_calls import (
    TOOL_PARSERS,
    ToolCallStream,
    detect_tool_parser,
    drops_tags,
    parse_tool_calls,
)
from engine.outputs import CompletionOutput, RequestOutput


def _splits(text: str) -> list[list[str]]:
    """One character per delta, and every split into two deltas (each boundary on its own)."""
    return [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]


# ---------------------------------------------------------------------- reasoning

REASONING_CASES = [
    # (parser, output, reasoning_content, content)
    ("deepseek_r1", "abc</think>hello", "abc", "hello"),
    ("deepseek_r1", "<think>abc</think>hello", "abc", "hello"),       # the output opened the tag itself
    ("deepseek_r1", "\n<think>\nabc\n</think>\n\nhi", "\nabc\n", "\n\nhi"),
    ("deepseek_r1", "still thinking", "still thinking", None),        # no </think> by the end: all reasoning
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),        # only the first closes the reasoning
    ("deepseek_r1", "a</thin", "a</thin", None),                      # a partial tag at the end is text
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>abc</think>hello", "abc", "hello"),
    ("qwen3", "\n<think>\nabc</think>\n\nhello", "\nabc", "\n\nhello"),
    ("qwen3", "hello <think>x</think>", None, "hello <think>x</think>"),  # not leading: content
    ("qwen3", "no thinking here", None, "no thinking here"),         # enable_thinking=False
    ("qwen3", "<think></think>answer", None, "answer"),
    ("qwen3", "<think>cut short", "cut short", None),                 # never closed: reasoning, as it streamed
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "  ", None, "  "),
]


@pytest.mark.parametrize("parser, text, reasoning, content", REASONING_CASES)
def test_reasoning_whole_and_streamed_at_every_split(parser, text, reasoning, content):
    assert parse_reasoning(text, parser) == (reasoning, content)
    for pieces in _splits(text):
        stream, got_reasoning, got_content = REASONING_PARSERS[parser](), "", ""
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, finished=i == len(pieces) - 1)
            got_reasoning, got_content = got_reasoning + r, got_content + c
        assert (got_reasoning, got_content) == (reasoning or "", content or ""), pieces


def test_reasoning_streams_as_it_comes_holding_back_only_a_possible_tag():
    r1 = REASONING_PARSERS["deepseek_r1"]()
    assert r1.feed("let me think </th", False) == ("let me think ", "")
    assert r1.feed("ink> The answer", False) == ("", " The answer")
    assert r1.feed(" is 4.", True) == ("", " is 4.")
    qwen = REASONING_PARSERS["qwen3"]()
    assert qwen.feed("<thi", False) == ("", "")
    assert qwen.feed("nk>hmm", False) == ("hmm", "")
    qwen = REASONING_PARSERS["qwen3"]()
    assert qwen.feed("Hi", False) == ("", "Hi")  # no tag can come now: content at once


# ---------------------------------------------------------------------- tool calls

WX = ("wx", {"city": "Oslo"})
ADD = ("add", {"a": 1})
TOOL_CASES = [
    # (parser, output, content, calls)
    ("hermes", 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "wx", '
               '"arguments": {"city": "Oslo"}}</tool_call> bye', "Sure.\n bye", [ADD, WX]),
    ("hermes", 'x <tool_call>not json</tool_call><tool', "x <tool_call>not json</tool_call><tool", []),
    ("hermes", 'x <tool_call>{"name": "wx"', 'x <tool_call>{"name": "wx"', []),           # unclosed
    ("llama3_json", '{"name": "wx", "parameters": {"city": "Oslo"}}', "", [WX]),
    ("llama3_json", '<|python_tag|>{"name": "add", "arguments": {"a": 1}}; {"name": "wx", "parameters": '
                    '{"city": "Oslo"}}\n', "", [ADD, WX]),
    ("llama3_json", ' \n{"name": "f", "parameters": {"s": "}{;\\"]"}}', "", [("f", {"s": '}{;"]'})]),
    ("llama3_json", "The weather in Oslo is mild.", "The weather in Oslo is mild.", []),
    ("llama3_json", '{"name": "wx", "parameters": {"city": "Os', '{"name": "wx", "parameters": {"city": "Os', []),
    ("llama3_json", '{"city": "Oslo"}', '{"city": "Oslo"}', []),                         # JSON, not a call
    ("llama3_json", '{"name": "wx", "parameters": {bad}}', '{"name": "wx", "parameters": {bad}}', []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; oops', "; oops", [ADD]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and more', " and more", [ADD]),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", "<|python", "<|python", []),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "wx", "arguments": '
                '{"city": "Oslo"}}]', "Let me check.", [ADD, WX]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]wx[ARGS]{"city": "Oslo"}', "", [ADD, WX]),
    ("mistral", '[TOOL_CALLS]wx{"city": "Oslo"} ', "", [WX]),                            # without [ARGS]
    ("mistral", 'a[TOOL_CALLS]add[ARGS]{"a": 1} tail', "a tail", [ADD]),
    ("mistral", "no calls here [TOOL", "no calls here [TOOL", []),
    ("mistral", 'x [TOOL_CALLS][{"name": "wx"', 'x [TOOL_CALLS][{"name": "wx"', []),      # unclosed array
    ("mistral", "[TOOL_CALLS]wx[ARGS]{bad json}", "[TOOL_CALLS]wx[ARGS]{bad json}", []),
    ("mistral", '[TOOL_CALLS][{"nom": 1}]', '[TOOL_CALLS][{"nom": 1}]', []),
    ("mistral", "[TOOL_CALLS] ?", "[TOOL_CALLS] ?", []),
    ("mistral", "[TOOL_CALLS]wx[AR", "[TOOL_CALLS]wx[AR", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", TOOL_CASES)
def test_tool_calls_whole_and_streamed_at_every_split(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, parser)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    for pieces in _splits(text):
        stream, streamed, streamed_calls = ToolCallStream("auto", parser=parser), "", []
        for i, piece in enumerate(pieces):
            out, new_calls = stream.feed(piece, finished=i == len(pieces) - 1)
            streamed += out
            streamed_calls += new_calls
        assert (streamed, _calls(streamed_calls)) == (content, calls), pieces


@pytest.mark.parametrize("parser, text, before_call, first_content, first_calls", [
    ("hermes", 'Hello <tool_call>{"name": "wx"}</tool_call>', 'Hello <tool_call>{"name": "wx"}', "Hello ", []),
    ("llama3_json", '{"name": "wx", "parameters": {}}; {"name": "add", "parameters": {"a": 1}}',
     '{"name": "wx", "parameters": {}}', "", ["wx"]),
    ("mistral", 'Hello [TOOL_CALLS]wx[ARGS]{}[TOOL_CALLS]add[ARGS]{"a": 1}', "Hello [TOOL_CALLS]wx[ARGS]{}",
     "Hello ", ["wx"]),
])
def test_content_streams_at_once_and_each_call_once_complete(parser, text, before_call, first_content, first_calls):
    """Mid-stream: the content before a call goes out at once, a call as soon as it is complete (a Hermes call
    needs its closing tag), the rest once it comes."""
    stream = TOOL_PARSERS[parser]()
    content, calls = stream.feed(before_call, finished=False)
    assert (content, [c.name for c in calls]) == (first_content, first_calls)
    rest, more = stream.feed(text[len(before_call):], finished=True)
    assert rest == "" and [c.name for c in calls + more] == [c.name for c in parse_tool_calls(text, parser)[1]]


@pytest.mark.parametrize("template, parser", [
    ("...<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>...", "hermes"),
    ("{%- if tools %}[AVAILABLE_TOOLS]...{{ '[TOOL_CALLS]' }}", "mistral"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     "llama3_json"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_the_parser_is_chosen_from_the_chat_template(template, parser):
    assert detect_tool_parser(template) == parser


class _SkippingTokenizer:
    """Drops `special` when decoding with skip_special_tokens, as a tokenizer does its special tokens."""

    special = "[TOOL_CALLS]"

    def encode(self, text, add_special_tokens=True):
        return [text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ids).replace(self.special, "") if skip_special_tokens else "".join(ids)


def test_tags_that_the_tokenizer_would_skip_are_detected():
    tokenizer = _SkippingTokenizer()
    assert drops_tags(tokenizer, TOOL_PARSERS["mistral"].tags)
    assert not drops_tags(tokenizer, TOOL_PARSERS["hermes"].tags)
    assert not drops_tags(None, TOOL_PARSERS["mistral"].tags)


# ---------------------------------------------------------------------- both, as the chat response reads them


def _builder(**kwargs) -> ChatBuilder:
    stream = types.SimpleNamespace(request_ids=["r"])
    return ChatBuilder("chatcmpl-1", "m", stream, 1, [[1, 2]], None, None, **kwargs)


def _output(text: str, finished: bool) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [7], "stop" if finished else None)], finished)


def test_reasoning_is_split_off_before_tool_calls_are_read():
    """A call written while thinking is reasoning text; the one after </think> is a call."""
    text = 'call <tool_call>{"name": "add"}</tool_call>?</think>ok <tool_call>{"name": "wx"}</tool_call>'
    whole = _builder(tool_mode="auto", tool_parser="hermes", reasoning_parser="deepseek_r1")
    whole.add(_output(text, True))
    (choice,) = whole.response()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == 'call <tool_call>{"name": "add"}</tool_call>?'
    assert message["content"] == "ok " and [c["function"]["name"] for c in message["tool_calls"]] == ["wx"]
    assert choice["finish_reason"] == "tool_calls"

    streamed = _builder(tool_mode="auto", tool_parser="hermes", reasoning_parser="deepseek_r1")
    deltas = []
    for i, ch in enumerate(text):
        for index, delta in streamed.add(_output(ch, i == len(text) - 1)):
            deltas.append(streamed.chunk(index, delta)["choices"][0])
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "ok "
    assert [c["function"]["name"] for d in deltas for c in d["delta"].get("tool_calls", [])] == ["wx"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_no_reasoning_parser_leaves_the_text_alone_and_forced_calls_skip_it():
    plain = _builder()
    plain.add(_output("<think>x</think>y", True))
    assert plain.response()["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}
    named = _builder(tool_mode="named", tool_name="wx", reasoning_parser="deepseek_r1")
    named.add(_output('{"city": "Oslo"}', True))
    message = named.response()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Oslo"}'
