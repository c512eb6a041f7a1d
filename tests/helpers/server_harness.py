"""A real uvicorn server on a loopback port over an LLMEngine, for the server test files: one engine
configuration throughout (a cache small enough to force preemption), so every server in a test process
shares the jitted step functions that the first requests compile."""

import contextlib
import dataclasses
import json
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.entrypoints.server import ServerConfig, build_app
from engine.llm_engine import LLMEngine

API_KEY = "sk-test-key"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 64
# 6 usable blocks of 16 tokens against 4 running sequences of up to 4 blocks each: preemption under load.
ENGINE = dict(block_size=16, num_blocks=7, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                 "{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
WORDS = "the quick brown fox hello world ferry jax tokenizer café über naïve emoji of a".split()
NO_EOS = {"ignore_eos": True}  # vLLM's extra field: lengths (and so token counts) are exact


@dataclasses.dataclass(slots=True)
class RunningServer:
    url: str                  # http://127.0.0.1:<port>
    engine: LLMEngine
    app: FastAPI

    @property
    def state(self):
        return self.app.state.server

    def settle(self, timeout_s: float = 20.0) -> None:
        """Wait until the engine thread has nothing left: no requests, no blocks, no held admission slots."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (not self.engine.has_unfinished() and self.engine.scheduler.block_pool.num_used == 0
                    and self.state.admission.num_waiting == 0):
                return
            time.sleep(0.02)
        raise AssertionError(f"did not settle: {self.engine.scheduler.stats()}, "
                             f"{self.state.admission.num_waiting} admission slots held")


@contextlib.contextmanager
def serve(model_dir: str, config: ServerConfig, on_fatal=None, **engine_config):
    """An engine behind a uvicorn server on a free loopback port, in a background thread. `engine_config`:
    EngineConfig fields that do not change the step shapes (e.g. async_scheduling)."""
    engine = LLMEngine(model_dir, EngineConfig(**ENGINE | engine_config))
    app = build_app(engine, config, on_fatal)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def post(server: RunningServer, path: str, body: dict | str) -> httpx.Response:
    """POST a JSON body (a str is sent as it is: malformed JSON on purpose)."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})


def metrics(server: RunningServer) -> dict[str, float]:
    """Every sample of /metrics by name and labels (model_name dropped), parsed by prometheus-client."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" in s.labels:
                continue  # histogram buckets: _count and _sum say enough here
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def prompt_len(server: RunningServer, **body) -> int:
    return post(server, "/tokenize", body).json()["count"]
