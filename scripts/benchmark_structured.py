"""Structured-output overhead: decode throughput at one batch size with every row constrained by a JSON schema
against the same batch unconstrained, and the time to compile a schema.

A random model with a real tokenizer's vocabulary (the mask work grows with the vocabulary): `--tokenizer`
is a model directory, a .gguf file or a packaged model's name (default smollm2: a 49152-token byte-level BPE).
Both runs sample at temperature 1 with ignore_eos off and the same seeds; constrained rows end when their
object is complete, so throughput is output tokens over wall time, per run.

    python scripts/benchmark_structured.py --batch=16 --json_out=structured.json
"""

import json
import time

from absl import app, flags

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured import GrammarCompiler
from models.config import ModelConfig
from models.loading import random_model
from models.packaged import resolve_packaged
from models.tokenizers.load import load_tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("tokenizer", "smollm2", "a model directory, .gguf file or packaged name whose tokenizer to use")
flags.DEFINE_integer("batch", 16, "requests decoded together")
flags.DEFINE_integer("output_len", 64, "most generated tokens per request")
flags.DEFINE_integer("layers", 4, "model layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("block_size", 16, "KV block size")
flags.DEFINE_integer("compile_repeats", 5, "fresh compilations of the schema to time")
flags.DEFINE_bool("warmup", True, "compile every step shape before measuring (--nowarmup: smoke runs)")
flags.DEFINE_string("json_out", None, "write results here")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
PROMPT_LEN = 16


def model_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=FLAGS.hidden,
                       intermediate_size=FLAGS.hidden * 4, num_layers=FLAGS.layers, num_heads=8, num_kv_heads=4,
                       head_dim=FLAGS.hidden // 8, max_position_embeddings=1024)


def run(engine: LLMEngine, spec: StructuredOutputsParams | None) -> dict:
    engine.step_times.update(schedule_s=0.0, execute_s=0.0, postprocess_s=0.0, outputs_s=0.0, steps=0)
    engine.runner.timings.update(device_s=0.0, pack_s=0.0)
    for i in range(FLAGS.batch):
        engine.add_request(None, list(range(100 + i, 100 + i + PROMPT_LEN)),
                           SamplingParams(temperature=1.0, seed=i, max_tokens=FLAGS.output_len,
                                          structured_outputs=spec))
    tokens, full_batch_s, t0 = 0, [], time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        new = sum(len(o.token_ids) for delta in engine.step() for o in delta.outputs)
        if new == FLAGS.batch:  # every row decoded: the steps to compare (constrained rows end early)
            full_batch_s.append(time.perf_counter() - t)
        tokens += new
    wall = time.perf_counter() - t0
    steps = engine.step_times["steps"]
    return dict(constrained=spec is not None, output_tokens=tokens, steps=steps, wall_s=wall,
                tokens_per_s=tokens / wall, step_ms=1e3 * wall / steps, full_batch_steps=len(full_batch_s),
                full_batch_step_ms=1e3 * sum(full_batch_s) / max(len(full_batch_s), 1),
                pack_ms_per_step=1e3 * engine.runner.timings["pack_s"] / steps,
                device_ms_per_step=1e3 * engine.runner.timings["device_s"] / steps)


def compile_times(tokenizer, vocab_size: int, eos_ids) -> dict:
    t0 = time.perf_counter()
    GrammarCompiler.for_tokenizer(tokenizer, vocab_size, eos_ids)
    tokenizer_s = time.perf_counter() - t0
    times = []
    for i in range(FLAGS.compile_repeats):  # a fresh compiler each time: no cache hit
        compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size, eos_ids)
        schema = {**SCHEMA, "description": f"variant {i}"}
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema)).matcher().allowed_mask()
        times.append(time.perf_counter() - t0)
    return dict(tokenizer_s=tokenizer_s, schema_compile_ms=1e3 * min(times), schema_compile_ms_max=1e3 * max(times))


def main(argv):
    del argv
    tokenizer = load_tokenizer(resolve_packaged(FLAGS.tokenizer))
    vocab_size = tokenizer.vocab_size
    model = random_model(model_config(vocab_size))
    max_len = PROMPT_LEN + FLAGS.output_len
    engine = LLMEngine(model, EngineConfig(
        block_size=FLAGS.block_size, max_num_seqs=FLAGS.batch, max_model_len=max_len,
        max_num_batched_tokens=max(FLAGS.batch * PROMPT_LEN, 16),
        num_blocks=1 + FLAGS.batch * -(-max_len // FLAGS.block_size)), tokenizer=tokenizer)
    if FLAGS.warmup:
        engine.warmup()
    spec = StructuredOutputsParams(json=SCHEMA)
    engine.compile_grammar(spec)
    run(engine, None)  # the first run pays any remaining one-off costs
    rows = [run(engine, None), run(engine, spec)]
    compiled = compile_times(tokenizer, vocab_size, engine.eos_token_ids)
    # Per step at the full batch: the constrained run's throughput also falls because its rows finish early.
    overhead = rows[1]["full_batch_step_ms"] / rows[0]["full_batch_step_ms"] - 1
    print(f"vocab {vocab_size}, batch {FLAGS.batch}, {FLAGS.layers} layers x {FLAGS.hidden}")
    print(f"{'rows':>12} {'tokens':>7} {'steps':>6} {'tok/s':>9} {'ms/step':>8} {'pack ms':>8} {'device ms':>9} "
          f"{'full-batch steps':>16} {'ms/full-batch step':>18}")
    for r in rows:
        print(f"{'constrained' if r['constrained'] else 'free':>12} {r['output_tokens']:>7} {r['steps']:>6} "
              f"{r['tokens_per_s']:>9.1f} {r['step_ms']:>8.2f} {r['pack_ms_per_step']:>8.2f} "
              f"{r['device_ms_per_step']:>9.2f} "
              f"{r['full_batch_steps']:>16} {r['full_batch_step_ms']:>18.2f}")
    print(f"overhead of constraining every row, per step at batch {FLAGS.batch}: {100 * overhead:.1f}%")
    print(f"llguidance tokenizer: {compiled['tokenizer_s']:.2f} s (once per engine); schema compile + first mask: "
          f"{compiled['schema_compile_ms']:.1f} ms (max {compiled['schema_compile_ms_max']:.1f})")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"config": {"tokenizer": FLAGS.tokenizer, "vocab": vocab_size, "batch": FLAGS.batch,
                                  "output_len": FLAGS.output_len, "layers": FLAGS.layers, "hidden": FLAGS.hidden},
                       "results": rows, "overhead": overhead, "compile": compiled}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
