"""Write notebooks/demo.ipynb from the cells below (edit here, then `python scripts/make_notebook.py`)."""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = [
    ("md", """# Ferry: continuous batching on JAX

This notebook installs Ferry, loads its embedded model (or a Hugging Face checkpoint), generates with
streaming output, shows continuous batching at work, and serves one request through the OpenAI client.
It runs on a CPU in a minute or two; on a Colab GPU it installs the `cuda12` extra.

In Colab, first get the repository: `!git clone <your Ferry repository> ferry` and `%cd ferry`."""),
    ("code", """import importlib.util, os, shutil, subprocess, sys

# Install Ferry unless it is importable already (it is, when this notebook runs inside the repo's venv).
if importlib.util.find_spec("engine") is None:
    extras = "demo,cuda12" if shutil.which("nvidia-smi") else "demo"
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", f".[{extras}]"])

import jax
print("JAX", jax.__version__, "on", jax.default_backend())"""),
    ("md", """## Load a model

`models/default` is the small model Ferry ships (trained by `scripts/train_tiny.py` on Python's own
documentation). Point `FERRY_MODEL` at a Hugging Face directory (`config.json` + `*.safetensors`) to use
a Llama, Qwen, Mistral or Gemma checkpoint instead."""),
    ("code", """from engine.engine import LLM, EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams

MODEL = os.environ.get("FERRY_MODEL", "models/default")
config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, block_size=16)
llm = LLM(MODEL, config)
cfg = llm.engine.model.cfg
print(f"{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")"""),
    ("md", "## Offline generation, streamed token by token"),
    ("code", """engine = llm.engine
engine.add_request("stream", "def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=48))
print("def fibonacci(n):", end="")
while engine.has_unfinished():
    for delta in engine.step():
        print(delta.outputs[0].text, end="", flush=True)
print()

outputs = llm.generate(["import", "The", "class"], SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=32),
                       use_tqdm=False)
for out in outputs:
    print(repr(out.prompt), "->", repr(out.outputs[0].text))"""),
    ("md", """## Continuous batching at work

Forty requests of mixed lengths arrive at once into a cache that cannot hold them all. Each step the
scheduler reaps finished requests, admits waiting ones into the freed blocks, preempts when memory runs
out, and decodes everyone running: the batch size and the KV cache usage move step by step."""),
    ("code", """import numpy as np
import matplotlib
import matplotlib.pyplot as plt

rng = np.random.default_rng(0)
busy = LLMEngine(MODEL, EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256,
                                     block_size=16, num_blocks=48))
for i in range(40):
    prompt = rng.integers(5, cfg.vocab_size, size=int(rng.integers(8, 64))).tolist()
    busy.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 64)), ignore_eos=True))
batch, usage = [], []
while busy.has_unfinished():
    busy.step()
    trace = dict(busy.scheduler.step_traces[-1])
    batch.append(len(trace["decode"]["decodes"]))
    usage.append(busy.scheduler.kv_usage)
print(busy.scheduler.stats())

fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(batch, label="decode batch size")
ax.set_xlabel("step"); ax.set_ylabel("requests")
ax2 = ax.twinx(); ax2.plot(usage, color="tab:orange", label="KV cache usage"); ax2.set_ylabel("KV usage")
fig.legend(loc="upper right"); plt.show()"""),
    ("md", "## Throughput against batch size"),
    ("code", """import time

rows = []
for size in (1, 4, 16):
    eng = LLMEngine(MODEL, EngineConfig(max_num_seqs=size, max_num_batched_tokens=max(64, 32 * size),
                                        max_model_len=128, block_size=16))
    eng.warmup(sampling=False)
    for _ in range(size):
        eng.add_request(None, list(range(5, 37)), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    start = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    rows.append((size, size * 32 / (time.perf_counter() - start)))
for size, tps in rows:
    print(f"batch {size:>3}: {tps:8.1f} output tokens/s")
plt.figure(figsize=(5, 3)); plt.plot(*zip(*rows), marker="o")
plt.xlabel("batch size"); plt.ylabel("output tokens/s"); plt.xscale("log", base=2); plt.show()"""),
    ("md", """## Serve it: the OpenAI-compatible API

`make serve` (or `python -m engine.serve --model=DIR`) runs this server from a shell. Here it runs in a
background thread on a free port, and the official `openai` client talks to it."""),
    ("code", """import socket, threading
import uvicorn
from openai import OpenAI
from engine.server import ServerConfig, build_app

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
app = build_app(LLMEngine(MODEL, config), ServerConfig(served_model_name="ferry-demo"))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
thread = threading.Thread(target=server.run, daemon=True); thread.start()
while not server.started:
    time.sleep(0.1)

client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
reply = client.completions.create(model="ferry-demo", prompt="def add(a, b):", max_tokens=24, temperature=0)
print(repr(reply.choices[0].text), reply.usage)
server.should_exit = True; thread.join(timeout=30)"""),
]


def main():
    cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in CELLS]
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}, "accelerator": "GPU", "colab": {"provenance": []}})
    path = os.path.join(ROOT, "notebooks", "demo.ipynb")
    nbformat.write(nb, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
