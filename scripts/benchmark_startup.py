"""Start-up cost: how long until Ferry is ready, and how many XLA programs it compiles on the way.

Two measurements, each in a fresh process so nothing compiled earlier is reused in memory:

  warmup   `LLMEngine.warmup()` of random Llamas of the same width and growing depth (--layers),
           with the persistent compilation cache off: seconds and compiled programs.
  serve    `python -m engine.entrypoints.serve --model=M` until /health answers 200, first with an empty persistent
           compilation cache (cold; kept running until its background warm-up is done, also timed), then
           again with the cache it filled (warm), for every M of
           --serve_model (directories, .gguf files or packaged names) and a random Llama of the
           --hidden width per depth in --serve_random_layers (saved as a Ferry checkpoint with
           models/default's tokenizer; its vocabulary is models/default's).

    python scripts/benchmark_startup.py --layers=4,8,30 --hidden=512 --serve_model=models/default,smollm2 \
        --serve_random_layers=8,30 --json_out=startup.json

It only uses LLMEngine.warmup() and the serve command line, so the same script times older commits
too (run it with PYTHONPATH pointing at their checkout).
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request

import bench_common as bc
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["4", "8", "30"], "depths of the random Llamas to warm up")
flags.DEFINE_integer("hidden", 512, "random model: hidden size")
flags.DEFINE_integer("heads", 8, "random model: attention heads")
flags.DEFINE_integer("kv_heads", 4, "random model: key/value heads")
flags.DEFINE_integer("vocab", 4096, "random model: vocabulary size")
flags.DEFINE_integer("max_model_len", 512, "engine max_model_len of the random models")
flags.DEFINE_integer("max_num_seqs", 64, "EngineConfig.max_num_seqs of the random models")
flags.DEFINE_integer("max_num_batched_tokens", 512, "EngineConfig.max_num_batched_tokens of the random models")
flags.DEFINE_integer("num_blocks", 256, "KV blocks of the random models (the compiled shapes do not depend on it)")
flags.DEFINE_list("serve_model", [], "also time `engine.entrypoints.serve` on these models to /health 200")
flags.DEFINE_list("serve_random_layers", [],
                  "also time `engine.entrypoints.serve` on a random Llama of each of these depths")
flags.DEFINE_list("serve_flags", [], "extra engine.entrypoints.serve flags, e.g. --warmup=lazy")
flags.DEFINE_integer("port", 8791, "port for the serve measurement")
flags.DEFINE_float("serve_timeout_s", 900, "give up on a serve start after this long")
flags.DEFINE_integer("child_layers", None, "internal: warm one model up in this process and print JSON")
flags.DEFINE_string("json_out", None, "write every result here")


def random_llama_config(layers: int, vocab: int):
    from models.config import ModelConfig

    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=FLAGS.hidden,
                       intermediate_size=FLAGS.hidden * 3, num_layers=layers, num_heads=FLAGS.heads,
                       num_kv_heads=FLAGS.kv_heads, head_dim=FLAGS.hidden // FLAGS.heads,
                       max_position_embeddings=FLAGS.max_model_len)


def warm_one(layers: int) -> dict:
    """In this process: build the engine, warm it up, count compilations."""
    os.environ["FERRY_COMPILATION_CACHE"] = "0"
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.worker.compilation import CompileCounter
    from models.loading import random_model

    t0 = time.perf_counter()
    engine = LLMEngine(random_model(random_llama_config(layers, FLAGS.vocab)), EngineConfig(
        num_blocks=FLAGS.num_blocks, max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens))
    build_s = time.perf_counter() - t0
    counter = CompileCounter.install()
    before, load = counter.count, os.getloadavg()
    t0, cpu0 = time.perf_counter(), time.process_time()
    engine.warmup()
    # CPU seconds (all threads) as well as wall: on a shared machine the wall clock depends on the neighbours.
    return {"layers": layers, "engine_s": build_s, "warmup_s": time.perf_counter() - t0,
            "warmup_cpu_s": time.process_time() - cpu0, "compiled_programs": counter.count - before,
            "load_before": load}


def time_warmups() -> list[dict]:
    results = []
    for layers in FLAGS.layers:
        cmd = [sys.executable, os.path.abspath(__file__), f"--child_layers={layers}"] + [
            f"--{name}={FLAGS[name].value}" for name in ("hidden", "heads", "kv_heads", "vocab", "max_model_len",
                                                          "max_num_seqs", "max_num_batched_tokens", "num_blocks")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(f"warm-up, {layers} layers: {results[-1]}", flush=True)
    return results


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_to_ready(model: str, cache_dir: str, log_path: str, wait_for_background: bool) -> tuple[float, float,
                                                                                                 float | None]:
    """Seconds from launching engine.entrypoints.serve to /health answering 200, the CPU seconds the server used (up to
    its exit), and with `wait_for_background` the seconds until its background warm-up had compiled every
    program (None if it had none): a cold start then leaves the whole cache, as a server that ran a while
    would, for the warm start after it. Its log goes to `log_path`."""
    env = dict(os.environ, FERRY_COMPILATION_CACHE=cache_dir)
    cmd = [sys.executable, "-m", "engine.entrypoints.serve", f"--model={model}", f"--port={FLAGS.port}",
           *FLAGS.serve_flags]
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while time.perf_counter() - t0 < FLAGS.serve_timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"engine.entrypoints.serve exited with {proc.returncode}: "
                                   f"{open(log_path).read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{FLAGS.port}/health", timeout=1) as r:
                    if r.status == 200:
                        wall = time.perf_counter() - t0
                        background = wait_for_background_warmup(log_path, t0) if wait_for_background else None
                        stop(proc)
                        return wall, _children_cpu_s() - cpu0, background
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"engine.entrypoints.serve not ready after {FLAGS.serve_timeout_s} s")
    finally:
        if proc.poll() is None:
            stop(proc)


def wait_for_background_warmup(log_path: str, t0: float) -> float | None:
    """Seconds from t0 until the server logs that its background warm-up is done; None if it started none."""
    while time.perf_counter() - t0 < FLAGS.serve_timeout_s:
        log = open(log_path).read()
        if "compiling in the background" not in log:
            return None
        if "background thread compiled" in log:
            return time.perf_counter() - t0
        time.sleep(0.2)
    raise TimeoutError(f"the background warm-up not done after {FLAGS.serve_timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL after 10 s: a lazy warm-up still compiling the full
    sampler in the background can hold the exit up, and only the time to ready is measured here."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        print(f"engine.entrypoints.serve (pid {proc.pid}) still running 10 s after SIGTERM: killed", flush=True)
        proc.kill()
        proc.wait(timeout=30)


def startup_lines(log_path: str) -> list[str]:
    """The server's own account of its start-up (the engine's "start-up took ..." line), if it logs one."""
    return [line.strip() for line in open(log_path) if "start-up took" in line]


def time_serve(model: str, label: str) -> dict:
    out = {"model": label, "flags": FLAGS.serve_flags, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="ferry_startup_cache_") as cache_dir:
        for run in ("cold", "warm"):  # the cold start fills the cache the warm one reads
            log_path = os.path.join(cache_dir, f"serve_{run}.log")
            wall, cpu, background = time_to_ready(model, cache_dir, log_path, wait_for_background=run == "cold")
            out.update({f"{run}_s": wall, f"{run}_cpu_s": cpu, f"{run}_log": startup_lines(log_path)})
            if run == "cold":
                out["cold_background_s"] = background
            print(f"serve {label}: {run} {wall:.1f} s ({cpu:.1f} CPU s) {out[f'{run}_log']}", flush=True)
    return out


def save_random_llama(layers: int, out_dir: str) -> str:
    """A random Llama of --hidden width as a Ferry checkpoint that `engine.entrypoints.serve` can load, with the
    embedded model's tokenizer (and so its vocabulary)."""
    from models.checkpoints.ferry import save_checkpoint
    from models.loading import load_model, random_model

    tokenizer_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "default")
    vocab = load_model(tokenizer_dir).cfg.vocab_size
    return save_checkpoint(random_model(random_llama_config(layers, vocab)), out_dir, tokenizer_dir=tokenizer_dir)


def time_serves() -> list[dict]:
    results = [time_serve(model, model) for model in FLAGS.serve_model]
    with tempfile.TemporaryDirectory(prefix="ferry_startup_models_") as scratch:
        for layers in FLAGS.serve_random_layers:
            model_dir = save_random_llama(int(layers), os.path.join(scratch, f"random_{layers}"))
            results.append(time_serve(model_dir, f"random llama, {layers} layers x {FLAGS.hidden}"))
    return results


def load_text(load) -> str:
    """The 1/5/15-minute load averages (the machine is shared: the figures depend on its neighbours)."""
    return " ".join(f"{v:.2f}" for v in load) if load else "-"


def main(argv):
    del argv
    if FLAGS.child_layers is not None:
        print(json.dumps(warm_one(FLAGS.child_layers)))
        return
    warmups = time_warmups() if FLAGS.layers else []
    serves = time_serves()
    if warmups:
        print(bc.format_table(["layers", "engine s", "warm-up s", "warm-up CPU s", "programs", "load avg before"],
                              [[r["layers"], r["engine_s"], r["warmup_s"], r.get("warmup_cpu_s"),
                                r["compiled_programs"], load_text(r.get("load_before"))] for r in warmups]))
    if serves:
        print(bc.format_table(["serve", "cold s", "cold: all compiled s", "warm s", "cold CPU s", "warm CPU s",
                               "load avg before"],
                              [[r["model"], r["cold_s"], r["cold_background_s"], r["warm_s"], r["cold_cpu_s"],
                                r["warm_cpu_s"], load_text(r["load_before"])] for r in serves]))
    if FLAGS.json_out:
        bc.write_json(FLAGS.json_out, {"benchmark": "startup", "config": bc.flag_values(FLAGS),
                                       "environment": bc.environment(), "warmup": warmups, "serve": serves})


if __name__ == "__main__":
    app.run(main)
