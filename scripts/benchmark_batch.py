"""Decode throughput and host overhead against batch size, for one small random model.

For each batch size B the engine runs B requests (prompt --prompt_len, --output_len tokens each,
ignore_eos) with max_num_seqs = B after warm-up, and splits step time into host work (scheduling,
metadata packing, postprocessing) and the jitted device call.

    python scripts/benchmark_batch.py --batches=1,8,32,128 --json_out=batch.json
"""

import json
import time

from absl import app, flags

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from models.config import ModelConfig
from models.loading import random_model

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["1", "8", "32", "128"], "batch sizes to measure")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens per request")
flags.DEFINE_integer("output_len", 64, "generated tokens per request")
flags.DEFINE_integer("layers", 4, "model layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("vocab", 32000, "vocabulary size")
flags.DEFINE_integer("block_size", 16, "KV block size")
flags.DEFINE_string("json_out", None, "write results here")


def tiny_config():
    return ModelConfig(model_type="llama", vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden,
                       intermediate_size=FLAGS.hidden * 4, num_layers=FLAGS.layers, num_heads=8,
                       num_kv_heads=4, head_dim=FLAGS.hidden // 8, max_position_embeddings=1024)


def measure(model, batch: int) -> dict:
    max_len = FLAGS.prompt_len + FLAGS.output_len
    engine = LLMEngine(model, EngineConfig(
        block_size=FLAGS.block_size, max_num_seqs=batch, max_model_len=max_len,
        max_num_batched_tokens=max(batch * FLAGS.prompt_len, 16),
        num_blocks=1 + batch * -(-max_len // FLAGS.block_size)))
    warmup_s = engine.warmup(sampling=False)
    params = SamplingParams(temperature=0.0, max_tokens=FLAGS.output_len, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, list(range(3, 3 + FLAGS.prompt_len)), params)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    runner, times = engine.runner.timings, engine.step_times
    host = times["schedule_s"] + times["postprocess_s"] + times["outputs_s"] + runner["pack_s"]
    device = runner["device_s"]
    return dict(batch=batch, steps=steps, wall_s=wall, warmup_s=warmup_s,
                output_tokens=batch * FLAGS.output_len, tokens_per_s=batch * FLAGS.output_len / wall,
                step_ms=1e3 * wall / steps, host_share=host / wall, device_share=device / wall)


def main(argv):
    del argv
    model = random_model(tiny_config())
    rows = [measure(model, int(b)) for b in FLAGS.batches]
    print(f"{'batch':>6} {'steps':>6} {'tok/s':>9} {'ms/step':>8} {'host %':>7} {'jit call %':>10} {'warm-up s':>9}")
    for r in rows:
        print(f"{r['batch']:>6} {r['steps']:>6} {r['tokens_per_s']:>9.1f} {r['step_ms']:>8.2f} "
              f"{100 * r['host_share']:>7.1f} {100 * r['device_share']:>10.1f} {r['warmup_s']:>9.1f}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"config": {k: FLAGS[k].value for k in ("prompt_len", "output_len", "layers", "hidden", "vocab")},
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
