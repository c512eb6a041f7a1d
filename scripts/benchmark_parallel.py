"""Throughput at several tensor- and data-parallel sizes: scripts/benchmark_throughput.py (Ferry backend) once
per layout, each in its own process with --cpu_devices forced CPU devices (XLA_FLAGS must be set before
jax starts), then one table and one JSON.

    python scripts/benchmark_parallel.py --layouts=1x1,2x1,4x1,1x2 --json_out=parallel.json \\
        -- --num_prompts=64 --layers=4 --hidden=256

A layout is TPxDP. Every other flag after `--` goes to benchmark_throughput.py unchanged (the same seed, so
the same random model and workload). On forced CPU devices the devices share the host's cores: the figures
say what splitting costs (collectives, per-shard kernels), not what a real multi-accelerator host gains.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts import bench_common as bc  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("layouts", ["1x1", "2x1", "4x1", "1x2"], "TPxDP layouts to run")
flags.DEFINE_integer("cpu_devices", None, "forced CPU devices (default: the most any layout needs)")
flags.DEFINE_string("json_out", None, "write every result here")
flags.DEFINE_integer("timeout_s", 3600, "per layout")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_layout(text: str) -> tuple[int, int]:
    tp, dp = (int(x) for x in text.lower().split("x"))
    return tp, dp


def run_layout(tp: int, dp: int, devices: int, extra: list[str], scratch: str) -> dict:
    out = os.path.join(scratch, f"tp{tp}_dp{dp}.json")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "benchmark_throughput.py"), "--backend=ferry",
           f"--tensor_parallel_size={tp}", f"--data_parallel_size={dp}", f"--json_out={out}", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=FLAGS.timeout_s)
    if proc.returncode:
        raise RuntimeError(f"TP {tp} x DP {dp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.load(open(out))["results"]["ferry"]
    return {"tp": tp, "dp": dp, "median": result["median"], "warmup_s": result["warmup_s"],
            "compiles_after_warmup": result.get("compiles_after_warmup"),
            "all_outputs_complete": result["all_outputs_complete"]}


def main(argv):
    extra = argv[1:]
    layouts = [parse_layout(x) for x in FLAGS.layouts]
    devices = FLAGS.cpu_devices or max(tp * dp for tp, dp in layouts)
    with tempfile.TemporaryDirectory() as scratch:
        rows = [run_layout(tp, dp, devices, extra, scratch) for tp, dp in layouts]
    base = rows[0]["median"]["output_tokens_per_s"]
    print(f"\n{'TP':>3} {'DP':>3} {'out tok/s':>10} {'vs first':>9} {'step ms':>8} {'warm-up s':>10}")
    for row in rows:
        m = row["median"]
        row["ratio_to_first"] = m["output_tokens_per_s"] / base
        print(f"{row['tp']:>3} {row['dp']:>3} {m['output_tokens_per_s']:>10.1f} {row['ratio_to_first']:>8.2f}x "
              f"{m['step_ms_mean']:>8.2f} {row['warmup_s']:>10.1f}")
    if FLAGS.json_out:
        bc.write_json(FLAGS.json_out, {"benchmark": "parallel", "cpu_devices": devices, "throughput_flags": extra,
                                       "layouts": rows})
        print(f"\nwrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
