"""Host time per decode step with the device stubbed out: what the engine's own work costs at large batches.

The runner's jitted call is replaced by a stub that returns random tokens at once (or after --device_ms), so
a step's wall time is host work only. For each case B x C the engine takes B requests of C prompt tokens
(greedy, ignore_eos), prefills them (stubbed too), then times --steps decode steps of LLMEngine.step, per
phase: the core (schedule; runner: packing, the stub call, reading the tokens; postprocess: folding them in,
token stops, the step's news) and the outputs (detokenizing, stop strings, deltas); then --steps more with
the outputs on their own thread as the server runs them ("pipelined step": the core's critical path).

    python scripts/benchmark_host.py --json_out=host.json            # batch 64 to 1,024, context 1k to 32k

A GPU decode step of a small model takes a few milliseconds: the host must stay under that.
"""

import queue
import statistics
import threading
import time

import numpy as np
from absl import app, flags
from bench_common import environment, format_table, write_json

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, freeze_startup_heap
from engine.sampling_params import SamplingParams
from engine.worker.sampler import SampleOutput
from models.config import ModelConfig
from models.loading import random_model
from models.tokenizers.load import load_tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["64x1024", "128x1024", "256x1024", "512x1024", "1024x1024", "512x2048", "256x8192",
                            "64x32768"], "batch x context (prompt tokens) pairs")
flags.DEFINE_integer("steps", 30, "decode steps timed per case")
flags.DEFINE_integer("block_size", 16, "KV block size")
flags.DEFINE_bool("detokenize", True, "detokenize outputs (models/default's tokenizer); False: token ids only")
flags.DEFINE_float("device_ms", 0.0, "the stub device's step time (a sleep, the GIL released)")
flags.DEFINE_string("json_out", None, "write results here")

# LLMEngine.step_times keys: the core step (schedule, the runner's packing and stub call, postprocess with
# the step's news) is the engine thread's critical path; the outputs (detokenizing, stop strings, deltas)
# run on the server's output thread.
PHASES = (("schedule", "schedule_s"), ("runner", "execute_s"), ("postprocess", "postprocess_s"),
          ("outputs", "outputs_s"))


def stub_device_step(vocab_size: int, device_s: float, seed: int = 0):
    """The runner's device_step without a device: random tokens for every row, after `device_s` of sleep
    (a device's step time, during which the host thread releases the GIL, as a jitted call does)."""
    rng = np.random.default_rng(seed)

    def device_step(buf, sampling_md, layout, mode, scoring=None):
        if device_s:
            time.sleep(device_s)
        rows = layout.num_seqs
        zeros = np.zeros((rows, 1), np.float32)
        return SampleOutput(rng.integers(3, vocab_size, rows, dtype=np.int32), zeros[:, 0], zeros.astype(np.int32),
                            zeros), None

    return device_step


PREFILL_TOKENS = 16384  # per step: the prompts go in quickly, in about B x C / this steps (B < this)


def max_output_tokens(batch: int, context: int, steps: int) -> int:
    """Enough that no request ends before the timed steps (twice `steps`) do: the first prefilled decode during the
    rest's prefill."""
    prefill_steps = -(-batch * context // (PREFILL_TOKENS - batch))  # the decoders take a token each from the budget
    return 2 * steps + prefill_steps + 2


def stub_engine(batch: int, context: int, steps: int, tokenizer) -> LLMEngine:
    """An engine over a one-layer model with the smallest KV cache that fits, whose device is a stub."""
    vocab = tokenizer.vocab_size if tokenizer is not None else 4096
    max_len = context + max_output_tokens(batch, context, steps)
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=16, max_position_embeddings=max_len)
    blocks_per_seq = -(-max_len // FLAGS.block_size)
    engine = LLMEngine(random_model(cfg), EngineConfig(
        block_size=FLAGS.block_size, max_num_seqs=batch, max_model_len=max_len,
        max_num_batched_tokens=PREFILL_TOKENS, num_blocks=1 + batch * blocks_per_seq, num_host_blocks=0,
        # Synchronous steps: each call's phases are that step's own (a step planned ahead splits its device
        # time between two calls); the host work per step is the same either way.
        enable_prefix_caching=False, async_scheduling=False), tokenizer=tokenizer)
    engine.runner.device_step = stub_device_step(vocab, FLAGS.device_ms / 1e3)
    return engine


def start_engine(batch: int, context: int, tokenizer) -> LLMEngine:
    """A stub engine with `batch` requests of `context` prompt tokens, all prefilled and decoding."""
    engine = stub_engine(batch, context, FLAGS.steps, tokenizer)
    freeze_startup_heap()  # as engine.entrypoints.serve does before it takes requests
    rng = np.random.default_rng(batch * 100003 + context)
    params = SamplingParams(temperature=0.0, max_tokens=max_output_tokens(batch, context, FLAGS.steps), ignore_eos=True)
    vocab = engine.model.cfg.vocab_size
    for _ in range(batch):
        engine.add_request(None, rng.integers(3, vocab, context).tolist(), params)
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    return engine


def phase_medians(engine: LLMEngine, batch: int) -> dict:
    """Median milliseconds per decode step of each phase, over --steps steps of LLMEngine.step; and the core's
    thread CPU time ("core cpu"), which other processes on a shared machine inflate far less than wall time."""
    samples = {name: [] for name, _ in PHASES} | {"step": [], "core cpu": []}
    for _ in range(FLAGS.steps):
        before = dict(engine.step_times)
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        news = engine.step_core()  # LLMEngine.step, in its parts (no stop strings here to apply after it)
        samples["core cpu"].append(time.thread_time() - cpu0)
        engine.process_outputs(news)
        samples["step"].append(time.perf_counter() - t0)
        for name, key in PHASES:
            samples[name].append(engine.step_times[key] - before[key])
    check_all_running(engine, batch)
    return {name: 1e3 * statistics.median(values) for name, values in samples.items()}


def pipelined_step_ms(engine: LLMEngine, batch: int) -> float:
    """Milliseconds per step when the outputs run on their own thread, as in the server
    (engine/entrypoints/engine_loop.py):
    the core steps on while the output thread, at most two steps behind, catches up. Wall time over --steps
    steps until the output thread is done too, so it is the rate both threads keep up together."""
    news: queue.Queue = queue.Queue(maxsize=2)

    def outputs():
        while (item := news.get()) is not None:
            engine.process_outputs(item)

    thread = threading.Thread(target=outputs)
    t0 = time.perf_counter()
    thread.start()
    for _ in range(FLAGS.steps):
        news.put(engine.step_core())
    news.put(None)
    thread.join()
    elapsed = time.perf_counter() - t0
    check_all_running(engine, batch)
    return 1e3 * elapsed / FLAGS.steps


def check_all_running(engine: LLMEngine, batch: int) -> None:
    if engine.scheduler.num_running != batch:
        raise RuntimeError(f"{engine.scheduler.num_running} of {batch} requests ran to the end: the case is wrong")


def measure(batch: int, context: int, tokenizer) -> dict:
    t0 = time.perf_counter()
    engine = start_engine(batch, context, tokenizer)
    setup_s = time.perf_counter() - t0
    ms = phase_medians(engine, batch)
    ms["pipelined step"] = pipelined_step_ms(engine, batch)
    ms["core"] = ms["schedule"] + ms["runner"] + ms["postprocess"]
    return {"batch": batch, "context": context, "setup_s": setup_s, "device_ms": FLAGS.device_ms, "median_ms": ms,
            "core_us_per_request": 1e3 * ms["core"] / batch}


def main(argv):
    del argv
    tokenizer = load_tokenizer("models/default") if FLAGS.detokenize else None
    results = []
    for case in FLAGS.cases:
        batch, context = (int(x) for x in case.lower().split("x"))
        results.append(measure(batch, context, tokenizer))
        r = results[-1]
        print(f"{batch} x {context}: core {r['median_ms']['core']:.2f} ms (cpu {r['median_ms']['core cpu']:.2f}), "
              f"step {r['median_ms']['step']:.2f} ms", flush=True)
    columns = [name for name, _ in PHASES] + ["core", "core cpu", "step", "pipelined step"]
    headers = ["batch x context", *(f"{c} ms" for c in columns), "core us / request"]
    rows = [[f"{r['batch']} x {r['context']}", *(r["median_ms"][c] for c in columns), r["core_us_per_request"]]
            for r in results]
    print(format_table(headers, rows))
    if FLAGS.json_out:
        write_json(FLAGS.json_out, {"flags": {"cases": FLAGS.cases, "steps": FLAGS.steps, "device_ms": FLAGS.device_ms,
                                              "detokenize": FLAGS.detokenize}, "environment": environment(),
                                    "results": results})


if __name__ == "__main__":
    app.run(main)
