"""The OpenAI-compatible server end to end: a real uvicorn server on a loopback port over a small random
llama with a real (byte-level BPE) tokenizer, driven by the official `openai` client and raw httpx.

One engine configuration throughout (a cache small enough to force preemption), so every server in this
file shares the jitted step functions that the first requests compile.
"""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine.entrypoints.server import ServerConfig
from helpers.hf_models import make_text_model
from helpers.repo import ROOT as REPO_ROOT
from helpers.server_harness import (
    API_KEY,
    CHAT_TEMPLATE,
    ENGINE,
    MAX_MODEL_LEN,
    MODEL_NAME,
    NO_EOS,
    WORDS,
    RunningServer,
    delta,
    metrics,
    post,
    prompt_len,
    serve,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A random llama whose vocabulary is a byte-level BPE tokenizer's (with a chat template) beside it."""
    return make_text_model(tmp_path_factory, seed=0, chat_template=CHAT_TEMPLATE)[0]


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, ServerConfig(MODEL_NAME, api_key=API_KEY, log_interval_s=1.0)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


# ---------------------------------------------------------------------- the openai client


def test_completions_with_the_openai_client(server, client):
    greedy = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=12, temperature=0,
                                       extra_body=NO_EOS)
    (choice,) = greedy.choices
    assert choice.finish_reason == "length" and choice.text
    assert greedy.usage.prompt_tokens == prompt_len(server, prompt="hello world")
    assert greedy.usage.completion_tokens == 12
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + 12

    seeded = dict(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=16, temperature=0.9, seed=1234,
                  extra_body=NO_EOS)
    whole = client.completions.create(**seeded)
    chunks = list(client.completions.create(**seeded, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert client.completions.create(**{**seeded, "seed": 99}).choices[0].text != whole.choices[0].text

    # vLLM's extra sampling fields are accepted and act: top_k=1 samples the greedy text.
    extras = {**NO_EOS, "top_k": 1, "min_p": 0.01, "repetition_penalty": 1.0, "min_tokens": 2, "priority": 1,
              "stop_token_ids": [1]}
    top1 = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=12, temperature=1.0,
                                     extra_body=extras)
    assert top1.choices[0].text == choice.text


def test_completions_n_logprobs_batches_and_token_prompts(server, client):
    two = client.completions.create(model=MODEL_NAME, prompt="ferry jax", max_tokens=8, temperature=1.0, seed=7,
                                    n=2, logprobs=2, extra_body=NO_EOS)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens == 16 == sum(len(c.logprobs.tokens) for c in two.choices)
    for c in two.choices:
        assert len(c.logprobs.token_logprobs) == 8 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in c.logprobs.top_logprobs)  # top 2 and the sampled token
    # Sample i of a seeded request is seeded seed + i.
    second = client.completions.create(model=MODEL_NAME, prompt="ferry jax", max_tokens=8, temperature=1.0,
                                       seed=8, extra_body=NO_EOS)
    assert second.choices[0].text == two.choices[1].text

    # Streamed n=2 reassembles per choice index.
    streamed = ["", ""]
    for chunk in client.completions.create(model=MODEL_NAME, prompt="ferry jax", max_tokens=8, temperature=1.0,
                                           seed=7, n=2, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in two.choices]

    # A batch of prompts (strings and token ids): choice i*n + j is sample j of prompt i.
    ids = post(server, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    batch = client.completions.create(model=MODEL_NAME, prompt=["hello world", "of a"], max_tokens=6,
                                      temperature=0, extra_body=NO_EOS)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body=NO_EOS)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_ids.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + prompt_len(server, prompt="of a")
    assert batch.usage.completion_tokens == 12


def test_stop_strings(client):
    base = dict(model=MODEL_NAME, prompt="hello world", max_tokens=24, temperature=0, extra_body=NO_EOS)
    full = client.completions.create(**base).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3, full
    cut = client.completions.create(**base, stop=[stop, "never appears"]).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]
    streamed = client.completions.create(**base, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_chat_with_the_openai_client(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    seeded = dict(model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0.8, seed=3,
                  extra_body=NO_EOS)
    whole = client.chat.completions.create(**seeded)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == prompt_len(server, messages=messages)
    assert whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**seeded, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage == whole.usage

    with_logprobs = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                                   temperature=0, logprobs=True, top_logprobs=3, n=2,
                                                   extra_body=NO_EOS)
    assert with_logprobs.usage.completion_tokens == 10
    for c in with_logprobs.choices:
        assert len(c.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob
                   for t in c.logprobs.content)
    assert with_logprobs.choices[0].message.content == with_logprobs.choices[1].message.content  # greedy


def test_models_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    tokens = post(server, "/tokenize", {"prompt": "café über", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "café über"  # the BOS is special: skipped


# ---------------------------------------------------------------------- errors, auth, admission


def test_echo_returns_the_prompt_and_its_logprobs(server, client):
    """lm-evaluation-harness's scoring request (echo, logprobs, max_tokens 1) and vLLM's max_tokens 0, whole and
    streamed, for text and token-id prompts: the prompt's tokens come first, the first one's logprob null."""
    prompt = "the quick brown fox"
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    (choice,) = scored.choices
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).endswith(prompt)  # the BOS token's text first
    # With a continuation: the prompt's part is the same, then what a request without echo generates.
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                      extra_body=NO_EOS).choices[0]
    both = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, logprobs=1,
                                     echo=True, extra_body=NO_EOS)
    echoed = both.choices[0]
    assert echoed.text == prompt + plain.text and both.usage.completion_tokens == 3
    # (the scoring step is another program than the plain one: its float32 logprobs may differ in the last bits)
    assert echoed.logprobs.token_logprobs[0] is None
    assert echoed.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:] + plain.logprobs.token_logprobs,
                                                               abs=1e-5)
    assert echoed.logprobs.text_offset[len(ids)] == len(prompt)
    # Streamed: the first chunk carries the prompt; the chunks join to the whole response.
    text, logprobs = "", []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                           logprobs=1, echo=True, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            text += c.text
            logprobs += c.logprobs.token_logprobs if c.logprobs else []
    assert text == echoed.text and logprobs == echoed.logprobs.token_logprobs
    # A batch (lm-eval sends several token-id prompts at once), without logprobs.
    batch = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=0, echo=True)
    head = post(server, "/detokenize", {"tokens": ids[:2]}).json()["prompt"]
    assert [c.text for c in batch.choices] == [prompt, head]
    assert all(c.logprobs is None for c in batch.choices)
    server.settle()


def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(server):
    long_prompt = " ".join(WORDS * 8)
    messages = [{"role": "user", "content": "hi"}]
    completion = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4}
    cases = [
        ("/v1/completions", '{"model": "tiny-llama", "prompt": ', 400, None),
        ("/v1/completions", "[1, 2]", 400, None),
        ("/v1/completions", {**completion, "max_tokens": "x"}, 400, "max_tokens"),
        ("/v1/completions", {**completion, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {**completion, "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {**completion, "prompt": long_prompt}, 400, "prompt"),
        ("/v1/completions", {**completion, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("/v1/completions", {**completion, "model": "gpt-5"}, 404, "model"),
        ("/v1/completions", {**completion, "n": 0}, 400, "n"),
        ("/v1/completions", {**completion, "logprobs": 100}, 400, "logprobs"),
        ("/v1/completions", {**completion, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {**completion, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {**completion, "prompt": [5, 10**6]}, 400, "prompt"),
        ("/v1/completions", {**completion, "stop": [""]}, 400, "stop"),
        ("/v1/completions", {**completion, "seed": -1}, 400, "seed"),
        ("/v1/completions", {**completion, "top_k": -2}, 400, "top_k"),
        ("/v1/completions", {**completion, "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/completions", {**completion, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
        ("/v1/completions", {**completion, "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
        ("/v1/completions", {**completion, "echo": True, "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {**completion, "echo": True, "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {**completion, "echo": "yes"}, 400, "echo"),
        ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 4}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": long_prompt}]}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 100}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400,
         "chat_template_kwargs"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ]
    for path, body, status, param in cases:
        response = post(server, path, body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["message"], (body, error)
        assert error["type"] == "invalid_request_error", (body, error)
    assert post(server, "/v1/no_such_route", {}).status_code == 404
    server.settle()
    ok = post(server, "/v1/completions", {**completion, **NO_EOS})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    server.settle()


def test_api_key_is_required_except_for_health_andmetrics(server):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=10)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_past_max_waiting_is_a_503_with_retry_after(model_dir):
    with serve(model_dir, ServerConfig(MODEL_NAME, max_waiting=2)) as busy:
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 48, "temperature": 0, **NO_EOS}

        async def burst():
            async with httpx.AsyncClient(base_url=busy.url, timeout=120) as http:
                return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(24)])

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        for r in responses:
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
            else:
                assert r.json()["usage"]["completion_tokens"] == 48
        busy.settle()  # every admission slot came back: the next request is served
        assert httpx.post(busy.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_a_failing_engine_fails_requests_instead_of_hanging_them(model_dir):
    with serve(model_dir, ServerConfig(MODEL_NAME)) as broken:
        def step():
            raise RuntimeError("device lost")

        broken.engine.step_core = step
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
        failed = httpx.post(broken.url + "/v1/completions", json=body, timeout=30)
        assert failed.status_code == 503 and "device lost" in failed.json()["error"]["message"]
        assert httpx.get(broken.url + "/health", timeout=10).status_code == 503
        assert httpx.post(broken.url + "/v1/completions", json=body, timeout=30).status_code == 503


# ---------------------------------------------------------------------- metrics, aborts, load


def test_metrics_move_with_the_traffic(server, client):
    before = metrics(server)
    completion = client.completions.create(model=MODEL_NAME, prompt="of a", max_tokens=6, n=2, temperature=0.5,
                                           extra_body=NO_EOS)
    chat = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, stream=True, stream_options={"include_usage": True},
                                               extra_body=NO_EOS))[-1]
    server.settle()
    after = metrics(server)
    usages = [completion.usage, chat.usage]
    assert delta(before, after, "ferry:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 17
    assert delta(before, after, "ferry:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "ferry:request_success_total{finished_reason=length}") == 3  # choices
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(before, after, f"ferry:{histogram}_count") == 2, histogram
    # One per delta after a request's first: at least max_tokens - 1 (n=2's forked sample may lag by a step).
    assert delta(before, after, "ferry:inter_token_latency_seconds_count") >= 5 + 4
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"):
        assert after[f"ferry:{gauge}"] == 0, gauge
    # the engine's memory accounting (LLMEngine.memory): weights as stored, the KV cache
    assert after["ferry:weight_bytes"] > 0 and after["ferry:kv_bytes_per_token"] > 0
    assert after["ferry:kv_cache_bytes"] >= 16 * after["ferry:kv_bytes_per_token"]


def _hang_up_once_running(server: RunningServer, body: dict, wait_for_data: bool) -> None:
    """Send a request on a raw socket and close the connection once the engine runs it (and, streaming,
    once the first event arrived)."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + payload)
        received = b""
        while wait_for_data and b"data:" not in received:
            received += sock.recv(65536)
        deadline = time.monotonic() + 60
        while server.engine.num_requests == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_hanging_up_aborts_its_request(server, stream):
    before = metrics(server)
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 60, "stream": stream, **NO_EOS}
    _hang_up_once_running(server, body, wait_for_data=stream)
    server.settle()  # the abort freed its blocks and its admission slot
    after = metrics(server)
    assert delta(before, after, "ferry:request_success_total{finished_reason=abort}") == 1
    assert delta(before, after, "ferry:request_success_total{finished_reason=length}") == 0
    assert delta(before, after, "ferry:generation_tokens_total") < 60


def _load_requests() -> list[dict]:
    """16 distinct seeded requests of mixed prompt and output lengths."""
    return [dict(prompt=" ".join(WORDS[i % 5:i % 5 + 2 + (5 * i) % 13]), max_tokens=8 + (7 * i) % 17,
                 temperature=0.9, seed=100 + i) for i in range(16)]


def test_64_concurrent_streams_with_preemption_and_disconnects(server, client):
    """64 streaming clients over 16 seeded requests against a cache that forces preemption; a quarter hang
    up after two chunks. Every other stream's text is its request's text run alone, /health answers
    throughout, and afterwards every block is free."""
    requests = _load_requests()
    alone = [client.completions.create(model=MODEL_NAME, **r, extra_body=NO_EOS).choices[0].text for r in requests]
    server.settle()
    before = metrics(server)

    async def stream(api, i):
        hangs_up = i % 4 == 3
        request = dict(requests[i % 16], max_tokens=40) if hangs_up else requests[i % 16]
        chunks = await api.completions.create(model=MODEL_NAME, **request, stream=True,
                                              stream_options={"include_usage": True}, extra_body=NO_EOS)
        text, usage, finish_reason, num_chunks = "", None, None, 0
        async for chunk in chunks:
            num_chunks += 1
            if hangs_up and num_chunks == 2:
                await chunks.close()
                return None
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            usage = chunk.usage or usage
        return text, finish_reason, usage

    async def health_while(load):
        polls = []
        async with httpx.AsyncClient(timeout=30) as http:
            while not load.done():
                t0 = time.monotonic()
                polls.append(((await http.get(server.url + "/health")).status_code, time.monotonic() - t0))
                await asyncio.sleep(0.02)
        return polls

    async def main():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        load = asyncio.ensure_future(asyncio.gather(*[stream(api, i) for i in range(64)]))
        polls = await health_while(load)
        await api.close()
        return await load, polls

    results, polls = asyncio.run(main())
    for i, result in enumerate(results):
        if i % 4 == 3:
            assert result is None
            continue
        text, finish_reason, usage = result
        assert text == alone[i % 16], i
        assert finish_reason == "length" and usage.completion_tokens == requests[i % 16]["max_tokens"]
    assert len(polls) >= 3 and all(status == 200 for status, _ in polls), polls
    assert max(seconds for _, seconds in polls) < 5.0

    server.settle()
    after = metrics(server)
    preemptions = sum(delta(before, after, f"ferry:num_preemptions_total{{mode={m}}}") for m in ("swap", "recompute"))
    assert preemptions > 0
    # A hang-up whose request reached its 40 tokens before the disconnect reached the engine (a race that the
    # machine's load widens) counts as "length"; either way every sample counts exactly once.
    aborted = delta(before, after, "ferry:request_success_total{finished_reason=abort}")
    finished = delta(before, after, "ferry:request_success_total{finished_reason=length}")
    assert aborted + finished == 64 and finished >= 48 and aborted >= 8, (aborted, finished)
    assert after["ferry:kv_cache_usage_perc"] == 0 and after["ferry:num_requests_running"] == 0
    scheduler = server.engine.scheduler
    assert scheduler.block_pool.num_used == 0 and scheduler.host_pool.num_used == 0
    assert not server.engine.runner.kv.swapped  # no host copy of an aborted swapped request left behind


def test_sync_scheduling_streams_the_same_text(model_dir, server, client):
    """A server with async scheduling off: 16 concurrent seeded streams (preempting each other) and a stop
    string give the default (async scheduling) server's text, and every block comes back."""
    requests = _load_requests()
    alone = [client.completions.create(model=MODEL_NAME, **r, extra_body=NO_EOS).choices[0].text for r in requests]
    greedy = dict(prompt="hello world", max_tokens=24, temperature=0)
    full = client.completions.create(model=MODEL_NAME, **greedy, extra_body=NO_EOS).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert server.engine.step_times["planned_ahead"] > 0
    with serve(model_dir, ServerConfig(MODEL_NAME, api_key=API_KEY), async_scheduling=False) as running:
        api = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key=API_KEY, max_retries=0)

        async def stream(request):
            chunks = await api.completions.create(model=MODEL_NAME, **request, stream=True, extra_body=NO_EOS)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def main():
            texts = await asyncio.gather(*[stream(r) for r in requests], stream(dict(greedy, stop=stop)))
            await api.close()
            return texts

        texts = asyncio.run(main())
        assert texts[:-1] == alone
        assert texts[-1] == full[:full.index(stop)]
        running.settle()
        assert running.engine.step_times["planned_ahead"] == 0


# ---------------------------------------------------------------------- the command line


def test_serve_command_line(model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "engine.entrypoints.serve", f"--model={model_dir}", f"--port={port}", "--nowarmup",
            "--served_model_name=cli-model", "--api_key=cli-key", "--log_interval_s=0.2", "--engine_seed=5"]
    args += [f"--{k}={v}" for k, v in ENGINE.items()]
    with open(tmp_path / "out", "w") as stdout, open(tmp_path / "err", "w") as stderr:
        process = subprocess.Popen(args, stdout=stdout, stderr=stderr, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        while "curl" not in (tmp_path / "out").read_text():
            assert process.poll() is None, (tmp_path / "err").read_text()
            assert time.monotonic() < deadline, "no banner"
            time.sleep(0.1)
        banner = (tmp_path / "out").read_text()
        assert f"http://127.0.0.1:{port}/v1" in banner and "$FERRY_API_KEY" in banner and "cli-key" not in banner
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        cli = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli-key", max_retries=0)
        out = cli.completions.create(model="cli-model", prompt="hello", max_tokens=2, temperature=0,
                                     extra_body=NO_EOS)
        assert out.usage.completion_tokens == 2
        time.sleep(0.5)  # a throughput log line
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C: a graceful shutdown, and a clean exit
        process.wait(30)
    log = (tmp_path / "err").read_text()
    assert process.returncode == 0 and "Traceback" not in log, log
    assert "Application shutdown complete" in log and "Avg generation throughput" in log


def test_prefix_cache_salt_and_reset(server):
    """vLLM's `cache_salt` separates prefix caches between tenants, and POST /reset_prefix_cache empties the
    cache: hits (counted in /metrics) only for a repeat under the same salt, none after a reset."""
    prompt = " ".join(WORDS * 3)  # several full blocks of 16 tokens
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0, **NO_EOS}

    def hits_of(extra: dict) -> float:
        server.settle()
        before = metrics(server)
        response = post(server, "/v1/completions", {**body, **extra})
        assert response.status_code == 200, response.text
        server.settle()
        return delta(before, metrics(server), "ferry:prefix_cache_hits_total")

    assert post(server, "/reset_prefix_cache", {}).status_code == 200
    assert hits_of({"cache_salt": "alice"}) == 0
    assert hits_of({"cache_salt": "bob"}) == 0        # another tenant's blocks are not shared
    assert hits_of({"cache_salt": "alice"}) > 0
    assert post(server, "/reset_prefix_cache", {}).status_code == 200
    assert hits_of({"cache_salt": "alice"}) == 0      # forgotten
    assert post(server, "/v1/completions", {**body, "cache_salt": 7}).json()["error"]["param"] == "cache_salt"
