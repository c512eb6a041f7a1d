"""Smoke tests of the benchmark scripts at a tiny size: benchmark_throughput (ferry, ferry-static and
transformers on one random checkpoint; vllm asked for but skipped, as without a vLLM venv), benchmark_serving against
a fake streaming OpenAI server run
here, and plot_benchmarks on both results."""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers.repo import ROOT as REPO_ROOT

SCRIPTS = REPO_ROOT / "scripts"
# No persistent compilation cache: warm-up must really compile (and be counted).
ENV = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           FERRY_COMPILATION_CACHE="0")
TINY_THROUGHPUT = dict(layers=1, hidden=64, heads=4, kv_heads=2, vocab=256, intermediate=128, num_prompts=6,
                       prompt_len_range="4,16", output_len_range="4,16",
                       compare="ferry,ferry-sync,ferry-static,transformers,vllm",
                       repeats=2, static_batch=4, max_num_seqs=4, max_num_batched_tokens=64, single_prompt_len=8,
                       single_output_len=8, torch_threads=1, settle_s=0.1)
SERVING_LEVELS = [1, 4]
FAKE_TOKEN_DELAY_S = 0.001
BACKENDS = ("ferry", "ferry-sync", "ferry-static", "transformers")


# ------------------------------------------------------------------ a fake OpenAI-compatible server

class FakeOpenAIHandler(BaseHTTPRequestHandler):
    """Streams one chunk per token ("tok"), max_tokens of them, then usage and [DONE]."""

    bodies: list = []  # every completion request seen, for the test to inspect

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send_json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send_json({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        chat = self.path.endswith("/chat/completions")
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for i in range(body["max_tokens"]):
            time.sleep(FAKE_TOKEN_DELAY_S)
            choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
            choice["finish_reason"] = "length" if i == body["max_tokens"] - 1 else None
            self._event({"id": "x", "object": "chunk", "choices": [choice]})
        if body.get("stream_options", {}).get("include_usage"):
            self._event({"id": "x", "choices": [], "usage": {
                "prompt_tokens": len(prompt.split()), "completion_tokens": body["max_tokens"],
                "total_tokens": len(prompt.split()) + body["max_tokens"]}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture(scope="module")
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAIHandler)  # port 0: a free one
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ------------------------------------------------------------------ running the scripts

def _start(script: str, **flags) -> subprocess.Popen:
    args = [f"--{k}={v}" for k, v in flags.items()]
    return subprocess.Popen([sys.executable, str(SCRIPTS / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV)


def _finish(proc: subprocess.Popen, what: str, timeout_s: int = 300) -> str:
    output, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"{what} failed:\n{output[-5000:]}"
    return output


@pytest.fixture(scope="module")
def results(tmp_path_factory, fake_server):
    """Both benchmarks side by side (the serving one mostly waits on the fake server)."""
    out = tmp_path_factory.mktemp("bench")
    paths = {"throughput": out / "throughput.json", "serving": out / "serving.json",
             "chat": out / "serving_chat.json"}
    serving = dict(base_url=fake_server, num_prompts=6, prompt_len_range="3,10", output_len_range="2,12",
                   concurrency_sweep=",".join(map(str, SERVING_LEVELS)), slo_ttft_ms=60000, slo_tpot_ms=60000)
    procs = {"throughput": _start("benchmark_throughput.py", **TINY_THROUGHPUT, json_out=paths["throughput"]),
             "serving": _start("benchmark_serving.py", **serving, json_out=paths["serving"]),
             "chat": _start("benchmark_serving.py", **serving, endpoint="/v1/chat/completions",
                            model="fake-model", request_rate=200, json_out=paths["chat"])}
    outputs = {name: _finish(proc, name) for name, proc in procs.items()}
    return {"dir": out, "paths": paths, "outputs": outputs,
            "json": {name: json.loads(path.read_text()) for name, path in paths.items()}}


# ------------------------------------------------------------------ benchmark_throughput

def test_throughput_json(results):
    result, output = results["json"]["throughput"], results["outputs"]["throughput"]
    for key in ("benchmark", "config", "environment", "model", "engine_config", "workload", "results", "ratios",
                "single_request"):
        assert key in result, key
    assert "out tok/s" in output and "ferry/transformers" in output
    workload = result["workload"]
    assert workload["num_requests"] == 6
    assert 4 <= workload["prompt_len"]["min"] <= workload["prompt_len"]["max"] <= 16
    assert set(result["results"]) == set(BACKENDS)
    assert result["backends_skipped"] == {"vllm": "no --vllm_python"}  # no vLLM venv given: skipped, not failed
    for name in BACKENDS:
        r = result["results"][name]
        assert r["warmup_s"] > 0 and len(r["repeats"]) == 2 and r["all_outputs_complete"], name
        for rep in r["repeats"]:  # every request's own output tokens, no more (transformers pads)
            assert rep["output_tokens"] == workload["output_tokens"], name
            assert rep["requests_per_s"] > 0 and rep["output_tokens_per_s"] > 0, name
            assert rep["total_tokens_per_s"] > rep["output_tokens_per_s"], name
        assert r["median"]["output_tokens_per_s"] > 0
    for name in ("ferry", "ferry-sync", "ferry-static"):
        r = result["results"][name]
        assert r["compiles_after_warmup"] == 0, name
        m = r["median"]
        assert 0 < m["host_share"] < 1 and 0 < m["device_share"] < 1, name
        assert 0 < m["peak_kv_usage"] <= 1 and m["preemptions"] >= 0 and m["steps"] > 0, name
    assert result["results"]["ferry"]["warmup_compiles"] > 0
    assert result["results"]["ferry"]["median"]["planned_ahead"] > 0      # async scheduling, the default
    assert result["results"]["ferry-sync"]["median"]["planned_ahead"] == 0
    assert set(result["ratios"]) == {f"{a}/{b}" for i, a in enumerate(BACKENDS) for b in BACKENDS[i + 1:]}
    for r in result["ratios"].values():
        assert r["of_medians"] > 0 and len(r["paired"]) == 2
    single = result["single_request"]
    assert set(single["backends"]) == {"ferry", "ferry-sync", "transformers"}
    for s in single["backends"].values():
        assert s["median"]["output_tokens"] == 8 and s["median"]["ms_per_token"] > 0
    assert single["transformers_over_ferry_ms_per_token"] > 0


# ------------------------------------------------------------------ benchmark_serving

def _check_serving(result: dict, endpoint: str):
    assert result["benchmark"] == "serving" and result["model"] == "fake-model"
    assert [r["max_concurrency"] for r in result["runs"]] == SERVING_LEVELS
    bodies = [b for b in FakeOpenAIHandler.bodies if ("messages" in b) == endpoint.endswith("chat/completions")]
    assert all(b["stream"] and b["stream_options"]["include_usage"] and b["ignore_eos"] for b in bodies)
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and not run["errors"]
        assert run["usage_reported"]
        assert run["output_tokens"] == sum(r["output_tokens"] for r in run["per_request"])
        assert 6 * 2 <= run["output_tokens"] <= 6 * 12
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: all meet them
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = run[metric]
            assert s["n"] > 0 and 0 < s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], metric
        assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
        # TPOT is not checked against the fake delay: a busy client may read several chunks at once.
        # one gap per chunk after the first, all of them
        assert run["itl_ms"]["n"] == sum(r["num_chunks"] - 1 for r in run["per_request"])


def test_serving_json(results):
    _check_serving(results["json"]["serving"], "/v1/completions")
    output = results["outputs"]["serving"]
    assert "TTFT p99" in output and "goodput" in output


def test_serving_chat_poisson(results):
    result = results["json"]["chat"]
    _check_serving(result, "/v1/chat/completions")
    assert result["config"]["request_rate"] == 200
    starts = [r["start_s"] for r in result["runs"][0]["per_request"]]
    assert starts[-1] > starts[0]  # Poisson arrivals are spread out, not all at t=0


# ------------------------------------------------------------------ plot_benchmarks

def test_plots(results):
    paths, out_dir = results["paths"], results["dir"] / "plots"
    _finish(_start("plot_benchmarks.py", serving_json=f"{paths['serving']},{paths['chat']}",
                   throughput_json=paths["throughput"], out_dir=out_dir), "plot_benchmarks.py")
    for name in ("serving_throughput.png", "serving_latency.png", "throughput_backends.png"):
        png = out_dir / name
        assert png.exists() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_throughput_rejects_an_unknown_setting_before_building_anything():
    """ferry@field=value (the named variants' route too) checks its fields before any model is built."""
    proc = _start("benchmark_throughput.py", compare="ferry,ferry@max_num_batched_tokenz=64")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "max_num_batched_tokenz" in output, output[-3000:]
    assert "Writing model shards" not in output and "start-up took" not in output, output[-3000:]


def test_throughput_prefix_workloads_cache_on_and_off(tmp_path):
    """The multi-turn chat workload (over a shared system prompt), prefix caching on and off in one run:
    both complete every request with no compilation after warm-up; only the cached one hits."""
    path = tmp_path / "multi_turn.json"
    flags = {k: v for k, v in TINY_THROUGHPUT.items() if k not in ("compare", "static_batch", "torch_threads")}
    output = _finish(_start("benchmark_throughput.py", **(flags | dict(
        workload="multi_turn", turns=2, shared_prefix_len=32, compare="ferry,ferry-nocache", max_num_seqs=2,
        max_num_batched_tokens=32, single_request=False)), json_out=path), "multi_turn", timeout_s=900)
    assert "TTFT p99 ms" in output and "hit %" in output
    result = json.loads(path.read_text())
    assert result["workload"]["num_requests"] == 12
    for name in ("ferry", "ferry-nocache"):
        r = result["results"][name]
        assert r["all_outputs_complete"] and r["compiles_after_warmup"] == 0, name
        assert 0 < r["median"]["ttft_ms_p50"] <= r["median"]["ttft_ms_p99"], name
    assert result["results"]["ferry"]["median"]["prefix_cache_hit_rate"] > 0.25
    assert result["results"]["ferry-nocache"]["median"]["prefix_cache_hit_rate"] == 0
    # second turns resend their history: longer than any first turn (system prompt + a 4..16-token message)
    assert result["workload"]["prompt_len"]["max"] > 32 + 16
