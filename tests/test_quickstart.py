"""The README's first command (`make serve`) on a clean copy, the embedded model, and the demo notebook."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import nbformat
import pytest
from nbclient import NotebookClient
from openai import OpenAI

from helpers.repo import ROOT as REPO_ROOT
from models.config import ModelConfig
from models.loading import load_model
from models.tokenizers.load import load_tokenizer

ROOT = str(REPO_ROOT)
DEFAULT_MODEL = os.path.join(ROOT, "models", "default")


def _tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()
    pytest.fail("the quickstart test needs the git checkout (git ls-files)")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_embedded_model_loads_with_its_tokenizer():
    model = load_model(DEFAULT_MODEL)
    report = json.load(open(os.path.join(DEFAULT_MODEL, "train_report.json")))
    assert model.cfg == ModelConfig.from_json(report["model_config"])  # fields added since: their defaults
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    assert tokenizer.vocab_size == model.cfg.vocab_size
    assert tokenizer.bos_token_id == model.cfg.bos_token_id
    assert set(model.cfg.eos_token_ids) <= set(tokenizer.eos_token_ids)
    text = "def add(a, b):\n    return a + b  # café"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert report["held_out_perplexity"] * 10 <= report["uniform_perplexity"]


def test_make_serve_on_a_clean_copy(tmp_path):
    """`make serve` in a fresh copy of the tracked files serves SmolLM2-135M-Instruct: asked "What is the
    capital of France?" through the OpenAI client, it answers with Paris, streamed and not. The copy reuses this test
    run's environment (make -o: the install step counts as done) rather than installing a second one."""
    copy = tmp_path / "ferry"
    for name in _tracked_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), copy / name)
    port, venv = _free_port(), sys.prefix
    env = {**os.environ, "FERRY_COMPILATION_CACHE": "0", "PYTHONUNBUFFERED": "1"}
    command = ["make", "serve", f"PORT={port}", f"VENV={venv}", "-o", f"{venv}/.installed-serve",
               "SERVE_FLAGS=--max_num_seqs=4 --max_model_len=128 --nowarmup"]
    proc = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline, log = time.monotonic() + 300, []
        while True:
            assert proc.poll() is None, "make serve exited:\n" + "".join(log) + proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 300 s"
            time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model_name = client.models.list().data[0].id
        assert model_name == "smollm2"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=model_name, messages=question, max_tokens=24, temperature=0)
        assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(model=model_name, messages=question, max_tokens=24, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            reply.choices[0].message.content
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
    assert f"http://127.0.0.1:{port}" in output and "curl" in output, output


def test_demo_notebook_runs_end_to_end():
    """The notebook on its default model, SmolLM2-135M-Instruct (the registry package `make test` installs):
    real answers from LLM.chat and through the server, streaming, and both plots."""
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "demo.ipynb"), as_version=4)
    # Minutes of a 135M-parameter model, not compiles: its kernel runs XLA's CPU backend at its default
    # optimisation level, not the -O0 that tests/conftest.py sets for the tiny models (at -O0 it runs minutes).
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "")
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute(
        env={**os.environ, "XLA_FLAGS": flags})
    outputs = ["".join(o.get("text", "")) for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "\n".join(outputs)
    assert "30 layers" in text and "Paris" in text and "Tokyo" in text and "Berlin" in text, text
    assert "output tokens/s" in text and "preemptions" in text, text
    images = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 2, "the batching and throughput plots"
