"""The server's vLLM-compatible extras end to end, on real uvicorn servers over a small random llama: reasoning
output (--reasoning_parser) whole and streamed, "auto" tool calls in each format (--tool_call_parser, or chosen
from the chat template), CORS (--allowed_origins) with and without an API key, the profiler routes
(--profiler_dir), and bad flag values. The random model is made to write a given text by a `choice` constraint.

Three servers in all (the harness's engine configuration, so they share compiled programs): one with an API key,
deepseek_r1 reasoning, Hermes calls, CORS for one origin and the profiler; then, per tool format, one with qwen3
reasoning, the parser chosen from its chat template, no key, and CORS for any origin (llama3_json) or none
(mistral)."""

import subprocess
import sys

import httpx
import openai
import pytest

from engine.entrypoints.server import ServerConfig, build_app
from helpers.hf_models import make_text_model
from helpers.repo import ROOT as REPO_ROOT
from helpers.server_harness import API_KEY, MODEL_NAME, post, serve

SHORT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]
WX = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ORIGIN = "https://app.example"
# Per tool format: a chat template that names its call syntax (so the server picks the parser) and an output
# holding one call to wx, with content around it where the format has any.
FORMATS = {
    "llama3_json": (SHORT_TEMPLATE + "{# <|python_tag|> #}", '<think>hm</think>{"name": "wx", "parameters": {}}',
                    None),
    "mistral": (SHORT_TEMPLATE + "{# [TOOL_CALLS] #}", '<think>hm</think>ok [TOOL_CALLS]wx[ARGS]{}', "ok "),
}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def server(tmp_path_factory, profiles):
    model_dir = make_text_model(tmp_path_factory, seed=0, chat_template=SHORT_TEMPLATE)[0]
    config = ServerConfig(MODEL_NAME, api_key=API_KEY, reasoning_parser="deepseek_r1", allowed_origins=(ORIGIN,),
                          profiler_dir=str(profiles))
    with serve(model_dir, config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def format_server(request, tmp_path_factory):
    """(tool format, server): the format's parser chosen from the template, qwen3 reasoning, no API key."""
    template = FORMATS[request.param][0]
    model_dir = make_text_model(tmp_path_factory, seed=0, chat_template=template)[0]
    origins = ("*",) if request.param == "llama3_json" else None
    with serve(model_dir, ServerConfig(MODEL_NAME, reasoning_parser="qwen3", allowed_origins=origins)) as running:
        yield request.param, running


def _forced(text: str, **extra) -> dict:
    """A greedy chat request whose output can only be `text`."""
    return dict(model=MODEL_NAME, messages=MESSAGES, temperature=0.0,
                extra_body={"structured_outputs": {"choice": [text]}}, **extra)


def _streamed(client, body: dict) -> tuple[str, str, list, list]:
    """(reasoning_content, content, tool call deltas, finish reasons) of a streamed chat request."""
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    return reasoning, content, calls, [c.choices[0].finish_reason for c in chunks]


# ---------------------------------------------------------------------- reasoning and tool calls


def test_reasoning_content_whole_and_streamed(client):
    body = _forced("<think>abc</think>hello")
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "hello")
    assert _streamed(client, body)[:2] == ("abc", "hello")

    # R1: the prompt opened the reasoning; no </think> by the end means it was all reasoning.
    body = _forced("only thoughts")
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.reasoning_content, message.content) == ("only thoughts", None)
    assert _streamed(client, body)[:2] == ("only thoughts", "")


def test_hermes_tool_call_after_reasoning(client):
    """Calls are read from the content alone: the tag opened while thinking stays reasoning (read with the rest,
    it would have swallowed the call)."""
    body = _forced('<tool_call></think>ok <tool_call>{"name":"wx"}</tool_call>', tools=[WX])
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.message.reasoning_content == "<tool_call>"
    assert choice.message.content == "ok " and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("wx", "{}")]
    reasoning, content, calls, finishes = _streamed(client, body)
    assert (reasoning, content) == ("<tool_call>", "ok ")
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [(0, "wx", "{}")]
    assert finishes[-1] == "tool_calls"


def test_each_tool_format_chosen_from_the_template(format_server):
    tool_format, running = format_server
    assert running.state.tool_parser == tool_format
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
    text, content = FORMATS[tool_format][1:]
    body = _forced(text, tools=[WX])
    choice = client.chat.completions.create(**body).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("hm", content)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("wx", "{}")]
    assert choice.finish_reason == "tool_calls"
    reasoning, streamed_content, calls, finishes = _streamed(client, body)
    assert (reasoning, streamed_content) == ("hm", content or "")
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [(0, "wx", "{}")]
    assert finishes[-1] == "tool_calls"
    # qwen3: no leading <think>, no reasoning; without tools the call syntax is plain content.
    message = client.chat.completions.create(**_forced("plain</think>")).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "plain</think>")
    assert httpx.post(running.url + "/start_profile", timeout=10).status_code == 404  # no --profiler_dir


# ---------------------------------------------------------------------- CORS


def test_cors_preflight_needs_no_api_key_and_responses_carry_the_headers(server, format_server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    response = httpx.options(server.url + "/v1/chat/completions", headers=preflight, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    other = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"},
                          timeout=10)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers

    authorized = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN,
                                                               "Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert authorized.status_code == 200 and authorized.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN

    tool_format, running = format_server
    anyone = httpx.get(running.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert anyone.status_code == 200
    if tool_format == "llama3_json":  # --allowed_origins=*
        assert anyone.headers["access-control-allow-origin"] == "*"
    else:  # unset: no CORS at all
        assert "access-control-allow-origin" not in anyone.headers
        assert httpx.options(running.url + "/v1/models", headers=preflight, timeout=10).status_code == 405


# ---------------------------------------------------------------------- the profiler


def test_profiler_start_stop_writes_a_trace(server, client, profiles):
    assert post(server, "/stop_profile", {}).status_code == 409  # not started
    assert httpx.post(server.url + "/start_profile", timeout=10).status_code == 401  # behind the key
    assert post(server, "/start_profile", {}).status_code == 200
    try:
        again = post(server, "/start_profile", {})
        assert again.status_code == 409 and again.json()["error"]["code"] == "profile_running"
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    finally:
        assert post(server, "/stop_profile", {}).status_code == 200
    assert list(profiles.rglob("*.xplane.pb")), list(profiles.rglob("*"))
    assert post(server, "/stop_profile", {}).status_code == 409


# ---------------------------------------------------------------------- bad values


def test_bad_parser_names_are_refused(server, tmp_path):
    for field in ("reasoning_parser", "tool_call_parser"):
        with pytest.raises(ValueError, match=field):
            build_app(server.engine, ServerConfig(MODEL_NAME, **{field: "nope"}))
    args = [sys.executable, "-m", "engine.entrypoints.serve", "--model=unused", "--reasoning_parser=nope",
            "--tool_call_parser=deepseek"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2 and "reasoning_parser" in proc.stderr, proc.stderr
    assert "deepseek_r1" in proc.stderr and "qwen3" in proc.stderr  # the choices are named

