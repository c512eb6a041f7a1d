#!/usr/bin/env python
"""Check Ferry's TPU paged-attention kernel on a TPU VM: correctness against the references, timing,
and bandwidth against the chip's own copy bandwidth measured in the same run. The TPU counterpart of
scripts/gpu_check.py, with the same cases, inputs (NaN in every slot no sequence owns, shuffled
block tables), timing method and table.

  python scripts/tpu_check.py                      # real sizes, Mosaic-compiled kernel
  python scripts/tpu_check.py --json_out out.json  # also write the results as JSON
  python scripts/tpu_check.py --smoke              # tiny shapes, TPU interpreter, any backend
  python scripts/tpu_check.py --model DIR          # also one decode step of the model's shapes (random weights),
                                                   # timed beside its roofline

--model (a checkpoint directory, a GGUF file, or a directory holding only config.json) times the engine's decode
step (engine/worker/compilation.compile_step: the program scripts/aot_compile.py compiles) at --max_num_seqs
sequences of --max_model_len tokens, and sets it beside the roofline: the bytes the step must read
(aot_compile.ideal_decode_bytes) at this chip's measured copy bandwidth, and XLA's own bytes accessed.

The kernel is pallas_kernels/tpu/ragged_paged_attention.py (ragged paged attention: decode and chunked prefill
through one pallas_call). "decode split-K" is gpu_check's small-batch long-context case; the TPU
kernel has no split-K, so it shows how a few long sequences fare. Exits 1 on any mismatch.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from gpu_check import copy_bandwidth, median_time, parse_args, report, run_cases  # noqa: E402

from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention_tpu  # noqa: E402


def tpu_kernel(decode: bool, interpret: bool):
    """make_kernel(scale, soft_cap) for the TPU kernel (decode or prefill)."""
    def make(scale, soft_cap):
        def run(q, k, v, tables, lens, qsl=None):
            return ragged_paged_attention_tpu(q, k, v, tables, lens, qsl, decode=decode,
                                              scale=scale, soft_cap=soft_cap, interpret=interpret)
        return run
    return make


def parse_step_args(argv):
    """The decode-step options; the rest go to gpu_check's parser."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=None, help="time a decode step of this model's shapes (random weights)")
    p.add_argument("--max_num_seqs", type=int, default=64)
    p.add_argument("--max_model_len", type=int, default=2048)
    return p.parse_known_args(argv)


def decode_step_check(model_dir, num_seqs, max_model_len, block_size, copy_gbs, trials, inner, interpret):
    """One decode step of the model at num_seqs x max_model_len, timed; its roofline beside it."""
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from aot_compile import ideal_decode_bytes  # noqa: PLC0415

    from engine.worker.compilation import Buckets, compile_step  # noqa: PLC0415
    from engine.worker.packing import SeqSlice, pack  # noqa: PLC0415
    from models.loading import random_model, read_checkpoint  # noqa: PLC0415
    from models.mesh import make_mesh  # noqa: PLC0415
    from models.paged import init_kv_cache, kv_cache_groups  # noqa: PLC0415
    from models.transformer import StaticGraphDef  # noqa: PLC0415
    from pallas_kernels.kernels import Kernels  # noqa: PLC0415

    cfg = read_checkpoint(model_dir).cfg
    dtype = jnp.bfloat16
    model = random_model(cfg, dtype)
    mesh = make_mesh(jax.devices()[:1])
    kernels = Kernels.for_mesh(mesh, dtype, dtype, "pallas_tpu_interpret" if interpret else None)
    width = math.ceil(max_model_len / block_size)
    groups = kv_cache_groups(cfg)
    ids = width * groups.num_groups  # block ids per sequence: a logical block's in every KV cache group
    buckets = Buckets.make(num_seqs, num_seqs, width, kv_groups=groups.num_groups)
    layout = buckets.decode_layout(buckets.pick(buckets.decode_batch, num_seqs))
    cache = init_kv_cache(groups.num_slots, 1 + num_seqs * ids, block_size,
                          *kernels.kv_page_dims(cfg.num_kv_heads, cfg.head_dim, dtype), dtype)
    rng = np.random.default_rng(0)
    pages = rng.permutation(np.arange(1, 1 + num_seqs * ids)).reshape(num_seqs, ids).tolist()
    seqs = [SeqSlice([int(rng.integers(cfg.vocab_size))], max_model_len - 1, table) for table in pages]
    buf = pack(seqs, layout, block_size)
    fed = jnp.zeros(buckets.decode_batch[-1], jnp.int32)
    graphdef = StaticGraphDef.of(model.graphdef)
    compiled = compile_step(graphdef, model.state, cache, fed, layout, "greedy", kernels, mesh, block_size,
                            cfg.vocab_size)
    state = {"cache": cache}

    def step():
        out, _, state["cache"] = compiled(model.state, state["cache"], fed, buf, None)
        return out.tokens

    step_s = median_time(step, trials=trials, inner=inner)
    # what the step must read: the KV cache at the pages' padded size (docs/kernels.md)
    ideal = ideal_decode_bytes(cfg, layout.num_seqs, width * block_size, dtype, dtype, 1, cfg.vocab_size,
                               cache[0].shape[3:])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    row = dict(model=model_dir, num_seqs=layout.num_seqs, context=width * block_size, attention=kernels.attention,
               step_ms=step_s * 1e3, ideal_bytes=ideal, roofline_ms=ideal / (copy_gbs * 1e9) * 1e3,
               xla_bytes_body_once=float(cost.get("bytes accessed", 0.0)))
    row["pct_roofline"] = 100.0 * row["roofline_ms"] / row["step_ms"]
    print(f"decode step, {cfg.model_type} {cfg.num_layers} layers, {layout.num_seqs} x {row['context']} tokens "
          f"({kernels.attention}): {row['step_ms']:.2f} ms; roofline {row['roofline_ms']:.2f} ms "
          f"({ideal / 1e9:.3f} GB at {copy_gbs:.0f} GB/s copy bandwidth): {row['pct_roofline']:.0f}% of it; "
          f"XLA's bytes accessed (layer loop counted once) {row['xla_bytes_body_once'] / 1e9:.3f} GB", flush=True)
    return row


def main(argv=None):
    step_args, rest = parse_step_args(sys.argv[1:] if argv is None else argv)
    args = parse_args(rest)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    device = jax.devices()[0]
    interpret = args.smoke or jax.default_backend() != "tpu"
    if interpret and not args.smoke:
        print("no TPU here: running the kernel in the TPU interpreter (slow); use --smoke")
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"seed {seed}, {'TPU interpreter' if interpret else 'Mosaic'}", flush=True)
    t_start = time.perf_counter()
    decode = tpu_kernel(decode=True, interpret=interpret)
    copy_gbs, copy_s = copy_bandwidth(args.copy_gib, args.trials, args.inner)
    rows = run_cases(
        args, np.random.default_rng(seed), jax.random.key(seed), decode_kernel=decode,
        split_kernel=decode, prefill_kernel=tpu_kernel(decode=False, interpret=interpret))
    status = report(args, rows, {}, copy_gbs, copy_s, device, seed, interpret, t_start)
    if step_args.model:
        row = decode_step_check(step_args.model, step_args.max_num_seqs, step_args.max_model_len, args.block_size,
                                copy_gbs, args.trials, args.inner, interpret)
        if args.json_out:
            with open(args.json_out) as f:
                result = json.load(f)
            result["decode_step"] = row
            with open(args.json_out, "w") as f:
                json.dump(result, f, indent=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
