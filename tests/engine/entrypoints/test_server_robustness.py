"""No request can take the server down: a hostile client's inputs get a clean 4xx naming the field, a huge
prompt does not stall /health, a request that fails in the engine gets a 500 while the others go on, an
engine that dies ends the process non-zero, SIGTERM drains, and schemathesis fuzzes the OpenAPI schema."""

import asyncio
import collections
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from engine.entrypoints.server import ServerConfig
from engine.worker import model_runner
from helpers.hf_models import make_text_model
from helpers.repo import ROOT as REPO_ROOT
from helpers.server_harness import ENGINE, MODEL_NAME, NO_EOS, RunningServer, metrics, post, serve

ROOT = str(REPO_ROOT)
BASELINE = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 12, "temperature": 0, **NO_EOS}
LIMITS = dict(max_waiting=8, max_request_bytes=1 << 20, max_prompt_chars=4000, max_stop_strings=8,
              max_stop_chars=32)
FUZZ_EXAMPLES = 40  # per operation and generation mode (7 operations, 2 modes): up to 560 requests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory, seed=3)[0]


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, ServerConfig(MODEL_NAME, **LIMITS)) as running:
        yield running


@pytest.fixture(scope="module")
def baseline(server) -> str:
    return post(server, "/v1/completions", BASELINE).json()["choices"][0]["text"]


def _assert_unharmed(server: RunningServer, baseline: str) -> None:
    """The engine answers the baseline request with the same greedy text, and holds nothing when idle."""
    server.settle()
    assert post(server, "/v1/completions", BASELINE).json()["choices"][0]["text"] == baseline
    server.settle()
    scheduler = server.engine.scheduler
    assert scheduler.block_pool.num_used == 0 and scheduler.host_pool.num_used == 0
    assert not server.engine.runner.kv.swapped
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------------- every row of the table


def test_hostile_inputs_get_a_clean_4xx_naming_the_field(server, baseline):
    completion = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        # Values that used to overflow int32 inside the step (the engine died for everyone).
        ({**completion, "top_k": 2**31, "temperature": 1.0}, 400, "top_k"),
        ({**completion, "stop_token_ids": [2**31], "min_tokens": 2}, 400, "stop_token_ids"),
        ({**completion, "stop_token_ids": [10**6], "min_tokens": 2}, 400, "stop_token_ids"),
        ({**completion, "min_tokens": 2**31}, 400, "min_tokens"),
        ({**completion, "priority": 2**40}, 400, "priority"),
        # Strict JSON types: no silent coercion.
        ({**completion, "n": True}, 400, "n"),
        ({**completion, "top_k": True}, 400, "top_k"),
        ({**completion, "temperature": "0.5"}, 400, "temperature"),
        ({**completion, "max_tokens": 4.0}, 400, "max_tokens"),
        ({**completion, "stream": "yes"}, 400, "stream"),
        ({**completion, "temperature": float("nan")}, 400, "temperature"),
        # Invalid Unicode (JSON can carry lone surrogates).
        ({**completion, "prompt": "abc\ud800"}, 400, "prompt"),
        ({**completion, "prompt": ["ok", "\udfff"]}, 400, "prompt"),
        ({**completion, "stop": ["\ud800"]}, 400, "stop"),
        ({**chat, "messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages"),
        ({**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400, "messages"),
        # Limits with flags: stop strings, prompt characters (before tokenizing), a never-admittable batch.
        ({**completion, "stop": [f"s{i}" for i in range(9)]}, 400, "stop"),
        ({**completion, "stop": ["x" * 33]}, 400, "stop"),
        ({**completion, "prompt": "hello " * 1000}, 400, "prompt"),
        ({**chat, "messages": [{"role": "user", "content": "hello " * 1000}]}, 400, "messages"),
        ({**completion, "prompt": ["hello"] * 9}, 400, "prompt"),
    ]
    for body, status, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = post(server, path, json.dumps(body, allow_nan=True))
        assert response.status_code == status, (body, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == param and error["message"], (str(body)[:200], error)
    _assert_unharmed(server, baseline)


def test_limits_that_used_to_fail_in_the_step_are_gone(server, baseline):
    """min_tokens with EOS + 20 stop ids (the sampler's fixed 16-wide list) now runs; top_p that underflows
    float32 keeps the top token, so every seed gives the greedy text."""
    body = {**BASELINE, "min_tokens": 5, "stop_token_ids": list(range(3, 23)), "temperature": 0.7, "seed": 1}
    for stream in (False, True):
        response = post(server, "/v1/completions", {**body, "stream": stream})
        assert response.status_code == 200, response.text
    for seed in range(3):
        tiny_p = post(server, "/v1/completions", {**BASELINE, "temperature": 1.0, "top_p": 1e-300, "seed": seed})
        assert tiny_p.json()["choices"][0]["text"] == baseline
    _assert_unharmed(server, baseline)


def test_request_body_limit_is_a_413(server, baseline):
    big = json.dumps({**BASELINE, "prompt": "x" * (1 << 20)})
    assert post(server, "/v1/completions", big).status_code == 413

    def chunked():  # no Content-Length: the limit is counted as the body streams in
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536].encode()

    response = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    _assert_unharmed(server, baseline)


def test_a_huge_prompt_does_not_stall_health(model_dir):
    """Tokenizing runs on a worker thread: /health and other streams keep answering while a 2 MB prompt
    (seconds of tokenizing here) is in flight. Limits raised so that it is tokenized at all."""
    config = ServerConfig(MODEL_NAME, max_request_bytes=64 << 20, max_prompt_chars=10**9)
    with serve(model_dir, config) as running:
        huge = {**BASELINE, "prompt": "hello world the quick brown fox " * 65536}  # 2 MiB

        async def main():
            async with httpx.AsyncClient(base_url=running.url, timeout=300) as http:
                big = asyncio.ensure_future(http.post("/v1/completions", json=huge))
                await asyncio.sleep(0.2)
                small = asyncio.ensure_future(http.post("/v1/completions", json={**BASELINE, "max_tokens": 2}))
                polls = []
                while not big.done():
                    t0 = time.monotonic()
                    assert (await http.get("/health")).status_code == 200
                    polls.append(time.monotonic() - t0)
                    await asyncio.sleep(0.02)
                assert (await small).status_code == 200
                return await big, polls

        response, polls = asyncio.run(main())
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert len(polls) >= 3, "the prompt was tokenized too fast to observe anything"
        print(f"/health while a 2 MiB prompt was tokenized: {len(polls)} polls, worst {max(polls):.3f} s")
        assert max(polls) < 2.0, polls


# ---------------------------------------------------------------------- fault isolation


def _poison_seed(monkeypatch, seed: int):
    """Requests with this seed fail while the runner prepares their rows (a per-request fault in the step)."""
    original = model_runner.sampling_row

    def sampling_row(state, history_len, grammar_bitmasks):  # the worker's own copy of the request
        if state.params is not None and state.params.seed == seed and len(state.output_token_ids) >= 2:
            raise RuntimeError("injected fault")
        return original(state, history_len, grammar_bitmasks)

    monkeypatch.setattr(model_runner, "sampling_row", sampling_row)


def test_a_failing_request_gets_a_500_and_the_others_go_on(server, baseline, monkeypatch):
    requests = [{**BASELINE, "prompt": p, "temperature": 0.8, "seed": 10 + i, "max_tokens": 20}
                for i, p in enumerate(["hello", "the quick", "brown fox", "ferry jax"])]
    alone = [post(server, "/v1/completions", r).json()["choices"][0]["text"] for r in requests]
    before = metrics(server)
    _poison_seed(monkeypatch, 666)
    poisoned = {**BASELINE, "temperature": 0.8, "seed": 666, "max_tokens": 30}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            plain = [http.post("/v1/completions", json=r) for r in requests]
            bad = http.post("/v1/completions", json=poisoned)
            bad_stream = http.post("/v1/completions", json={**poisoned, "stream": True})
            return await asyncio.gather(bad, bad_stream, *plain)

    bad, bad_stream, *plain = asyncio.run(main())
    monkeypatch.undo()
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
    assert "injected fault" in bad.json()["error"]["message"]
    events = [line.removeprefix("data: ") for line in bad_stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_failed"
    assert [r.status_code for r in plain] == [200] * len(plain), [r.text[:300] for r in plain]
    assert [r.json()["choices"][0]["text"] for r in plain] == alone
    server.settle()
    assert metrics(server).get("ferry:request_success_total{finished_reason=error}", 0) - \
        before.get("ferry:request_success_total{finished_reason=error}", 0) == 2
    _assert_unharmed(server, baseline)


def test_an_engine_that_dies_reports_it_and_calls_on_fatal(model_dir):
    """A fault the engine cannot isolate (here: the scheduler) fails every request with a 503 and calls the
    server's on_fatal hook (engine.entrypoints.serve then exits with status 1)."""
    died = threading.Event()
    with serve(model_dir, ServerConfig(MODEL_NAME), on_fatal=lambda e: died.set()) as broken:
        def schedule(ahead: bool = False):
            raise RuntimeError("scheduler bug")

        broken.engine.scheduler.schedule = schedule
        response = post(broken, "/v1/completions", BASELINE)
        assert response.status_code == 503 and "scheduler bug" in response.json()["error"]["message"]
        assert died.wait(10)
        assert httpx.get(broken.url + "/health", timeout=10).status_code == 503


def test_serve_exits_non_zero_when_the_engine_dies(model_dir, tmp_path):
    launcher = ("import sys; from engine.core.scheduler import Scheduler\n"
                "def broken(self, ahead=False): raise RuntimeError('scheduler bug')\n"
                "Scheduler.schedule = broken\n"
                "from engine.entrypoints.serve import main; main(sys.argv)\n")
    with ServeProcess(model_dir, tmp_path, [], launcher=launcher) as (process, url):
        assert post_raw(url, BASELINE).status_code == 503
        assert process.wait(60) == 1
    assert "the engine died" in (tmp_path / "err").read_text()


# ---------------------------------------------------------------------- graceful shutdown


def post_raw(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


class ServeProcess:
    """`python -m engine.entrypoints.serve` (or a launcher script) on a free port; yields (process, base url) once it
    listens, and kills it by PID if it is still running at the end."""

    def __init__(self, model_dir, tmp_path, flags: list[str], launcher: str | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        engine_flags = [f"--{k}={v}" for k, v in {**ENGINE, "max_model_len": 2048, "num_blocks": 300}.items()]
        command = ["-c", launcher] if launcher else ["-m", "engine.entrypoints.serve"]
        self.args = [sys.executable, *command, f"--model={model_dir}", f"--port={self.port}", "--nowarmup",
                     f"--served_model_name={MODEL_NAME}", *engine_flags, *flags]
        self.out, self.err = tmp_path / "out", tmp_path / "err"

    def __enter__(self):
        with open(self.out, "w") as stdout, open(self.err, "w") as stderr:
            self.process = subprocess.Popen(self.args, stdout=stdout, stderr=stderr, cwd=ROOT)
        deadline = time.monotonic() + 180
        while "curl" not in self.out.read_text():
            assert self.process.poll() is None, self.err.read_text()
            assert time.monotonic() < deadline, "no banner"
            time.sleep(0.1)
        return self.process, f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def _stream_until_first_event(url: str, body: dict, events: list, started: threading.Event):
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()


@pytest.mark.parametrize("timeout_s", [0, 60])
def test_sigterm_drains_then_exits_zero(long_model_dir, tmp_path, timeout_s):
    """SIGTERM: new requests get a 503 at once; running ones finish if they can within --shutdown_timeout
    (60 s: they do), else (0 s) streams end with an error event and [DONE] and non-streamed requests get a
    JSON 503; the process exits 0."""
    long_body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1500 if timeout_s == 0 else 400,
                 "temperature": 0, **NO_EOS}
    with ServeProcess(long_model_dir, tmp_path, [f"--shutdown_timeout={timeout_s}"]) as (process, url):
        events, started = [], threading.Event()
        streamer = threading.Thread(target=_stream_until_first_event, args=(url, long_body, events, started))
        streamer.start()
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(post_raw(url, long_body)))
        waiter.start()
        assert started.wait(120), (tmp_path / "err").read_text()
        process.send_signal(signal.SIGTERM)
        if timeout_s:
            refused = post_raw(url, BASELINE)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
            assert httpx.get(url + "/health", timeout=10).status_code == 503
        streamer.join(120)
        waiter.join(120)
        assert process.wait(60) == 0, (tmp_path / "err").read_text()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if timeout_s:
        assert last["choices"][0]["finish_reason"] == "length"
        assert plain[0].status_code == 200 and plain[0].json()["usage"]["completion_tokens"] == 400
    else:
        assert last["error"]["code"] == "engine_unavailable" and "shutting down" in last["error"]["message"]
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "engine_unavailable"


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    """The same tiny model with room for long generations (so requests are still running at SIGTERM)."""
    return make_text_model(tmp_path_factory, seed=4, max_position_embeddings=2048)[0]


# ---------------------------------------------------------------------- schemathesis


def test_fuzz_the_openapi_schema(server, baseline):
    """Property: every request schemathesis generates from the app's own OpenAPI schema, valid (positive
    mode) or not (negative mode), gets a 2xx or a clean 4xx with OpenAI's error JSON; never a 5xx. Then the
    engine answers the baseline request with the same greedy text and holds no blocks."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    counts = collections.Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=server.url, timeout=120)
                counts[response.status_code // 100] += 1
                assert response.status_code < 500, (case.method, case.path, str(case.body)[:500], response.text[:500])
                if response.status_code >= 400:
                    assert response.json()["error"]["message"], response.text[:500]

            try:
                check()
            except Unsatisfiable:  # nothing to get wrong: an operation with no inputs has no invalid form
                assert mode is schemathesis.GenerationMode.NEGATIVE
                assert not (operation.body or operation.query or operation.path_parameters), operation.path
    print(f"schemathesis: {sum(counts.values())} generated requests, by status class: {dict(counts)}")
    assert counts[2] and counts[4]
    _assert_unharmed(server, baseline)
