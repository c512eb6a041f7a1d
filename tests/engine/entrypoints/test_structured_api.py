"""Structured outputs and tool calls through the OpenAI-compatible server, driven by the official `openai`
client: response_format (json_schema, json_object), vLLM's structured_outputs (regex, choice), parse() with a
pydantic model, forced tool calls ("required", a named function) whose arguments validate against the tool's
schema, Hermes-style "auto" tool calls parsed and streamed as deltas, and 400s naming the field."""

import json
import re
from typing import Literal

import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from engine.entrypoints.server import ServerConfig
from engine.entrypoints.tool_calls import ToolCallStream, parse_hermes
from helpers.hf_models import make_text_model
from helpers.server_harness import API_KEY, MODEL_NAME, post, serve

# A short prompt (the server's context is 64 tokens): the conversation's text, one line per message.
SHORT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["a", "bb"]}, "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_text_model(tmp_path_factory, seed=int(np.random.SeedSequence().entropy % 2**31),
                                chat_template=SHORT_TEMPLATE)[0]
    with serve(model_dir, ServerConfig(MODEL_NAME, api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _seed():
    return int(np.random.SeedSequence().entropy % 2**31)


def test_response_format_and_structured_outputs(server, client):
    many = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=50, temperature=1.0, seed=_seed(),
        response_format={"type": "json_schema", "json_schema": {"name": "row", "schema": SCHEMA, "strict": True}})
    assert len(many.choices) == 50
    for choice in many.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)

    regex = r"[0-9]{2}-[a-z]{1,4}"
    out = client.completions.create(model=MODEL_NAME, prompt="hello", n=20, temperature=1.0, seed=_seed(),
                                    max_tokens=32, extra_body={"structured_outputs": {"regex": regex}})
    assert all(c.finish_reason == "stop" and re.fullmatch(regex, c.text) for c in out.choices), out.choices
    labels = ["red", "green", "blue"]
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=20, temperature=1.0, seed=_seed(),
                                         extra_body={"structured_outputs": {"choice": labels}})
    assert {c.message.content for c in out.choices} <= set(labels)

    # Streamed: the deltas join to a valid object.
    chunks = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=_seed(),
                                            stream=True, response_format={"type": "json_object"}, max_tokens=50)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")


class Verdict(pydantic.BaseModel):
    label: Literal["yes", "no"]
    score: int = pydantic.Field(ge=0, le=9)


def test_parse_with_a_pydantic_model(client):
    for seed in [_seed() for _ in range(5)]:
        parsed = client.beta.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=seed,
                                                    response_format=Verdict)
        verdict = parsed.choices[0].message.parsed
        assert isinstance(verdict, Verdict) and 0 <= verdict.score <= 9


def test_forced_tool_calls_validate_against_the_tool_schema(client):
    required = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, n=20,
                                              tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                              seed=_seed())
    names = set()
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        names.add(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS_BY_NAME[call.function.name])
    assert names <= {"add", "wx"}

    named = {"type": "function", "function": {"name": "wx"}}
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named, n=10,
                                         temperature=1.0, seed=_seed())
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "wx" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS_BY_NAME["wx"])

    # Streamed: the first delta names the function, the argument deltas join to the arguments.
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice=named, temperature=1.0, seed=_seed(), stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "wx" and calls[0].id and all(tc.index == 0 for tc in calls)
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    jsonschema.validate(json.loads(arguments), SCHEMAS_BY_NAME["wx"])


def test_auto_tool_calls_are_parsed_and_streamed(client):
    """A model that writes Hermes-style `<tool_call>` JSON (here made to by a choice constraint) gets its calls
    back as tool_calls, streamed as deltas, with the text around them as content."""
    written = 'ok <tool_call>{"name": "wx"}</tool_call>'
    body = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0.0,
                extra_body={"structured_outputs": {"choice": [written]}})
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "ok "
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("wx", "{}")]
    chunks = list(client.chat.completions.create(**body, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "ok " and [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [(0, "wx",
                                                                                                           "{}")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_hermes_parser_on_split_deltas():
    text = 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "wx", ' \
           '"arguments": {"city": "Oslo"}}</tool_call> bye <tool_call>not json</tool_call><tool'
    content, calls = parse_hermes(text)
    assert content == "Sure.\n bye <tool_call>not json</tool_call><tool"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("wx", {"city": "Oslo"})]
    rng = np.random.default_rng()
    for _ in range(20):  # any split into deltas streams the same content and calls
        cuts = sorted(rng.choice(len(text), size=6, replace=False))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, streamed, streamed_calls = ToolCallStream("auto"), "", []
        for i, piece in enumerate(pieces):
            out, new_calls = stream.feed(piece, finished=i == len(pieces) - 1)
            streamed += out
            streamed_calls += new_calls
        assert streamed == content and [c.name for c in streamed_calls] == ["add", "wx"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 3}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_structured_requests_are_400s_naming_the_field(server, body, param):
    response = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    server.settle()
