"""Micro-benchmark: the native stacked matmul on a model's linears, each CPU path side by side.

    python scripts/bench_native_matmul.py [--rows 1 8 64 512] [--dtype bfloat16] [--json_out results.json]

A decoder layer's linears (fused QKV, output, gated gate/up, down) over --layers packed layers and the LM
head, at each batch of --rows rows, through every path this CPU has: its own (AVX-512 where present, else
AVX2 where present), AVX2 on an AVX-512 CPU (FERRY_NATIVE_NO_AVX512=1) and the portable loops
(FERRY_NATIVE_MATMUL_GENERIC=1). The switches are read on every call, so the paths take turns in one
process (time_side_by_side's blocks). A call runs every layer of one linear, as a model step does (the head:
its one layer); ms is per layer, and GFLOP/s is 2 M K N over it. The paths sum each column in the same
order: float32 x gives the same bits on every path (max_abs_diff against the first path; gated outputs
may differ in the last bits between the AVX-512 gate and the others).

--formats float32 bfloat16 int8 int4-g32 int4-g128 ... instead times the weight formats side by side on this
CPU's own path (the quantized ones: models.quantization.QuantizedWeight packed by pack_stacked; intN-gG: groups
of G rows of K with offsets, int8 per output channel without, uint4-gG as int4): ms per layer, the weight bytes
a layer streams over that time (GB/s), and the speed-up over float32 at the same rows. --linears picks some
of the linears. SmolLM2-135M's linears and Llama-3-8B's:

    python scripts/bench_native_matmul.py --formats float32 bfloat16 int8 int4-g32 int4-g128 --rows 1 4 64 \
        --hidden 576 --intermediate 1536 --q_heads 9 --kv_heads 3 --head_dim 64 --vocab 49152 --layers 30
    python scripts/bench_native_matmul.py --formats float32 int8 int4-g32 int4-g128 --rows 1 4 64 \
        --hidden 4096 --intermediate 14336 --q_heads 32 --kv_heads 8 --head_dim 128 --layers 2 \
        --linears gate_up down
"""

import argparse
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from bench_native_attention import add_common_flags, time_side_by_side

from pallas_kernels.native import library
from pallas_kernels.native import ops as native

PATHS = library.MATMUL_PATH_SWITCHES  # name -> the switches it sets (the others unset)


def paths_here(flags: set[str]) -> list[str]:
    """The paths that differ on this CPU: AVX2 only as its own path where the default is AVX-512."""
    names = ["default"]
    if "avx512f" in flags and {"avx2", "fma"} <= flags:
        names.append("avx2")
    return names + ["portable"]


def linears(args) -> dict[str, tuple[int, int, int, str | None]]:
    """name -> (K, N, layers, gated activation)."""
    qkv = (args.q_heads + 2 * args.kv_heads) * args.head_dim
    return {"qkv": (args.hidden, qkv, args.layers, None),
            "o": (args.q_heads * args.head_dim, args.hidden, args.layers, None),
            "gate_up": (args.hidden, 2 * args.intermediate, args.layers, "silu"),
            "down": (args.intermediate, args.hidden, args.layers, None),
            "lm_head": (args.hidden, args.vocab, 1, None)}


def weight_stack(rng, fmt: str, num_layers: int, k: int, n: int):
    """A random [L, K, N] stack in format `fmt` (float32, bfloat16, int8, int4-gG, uint4-gG): values over the
    format's range (timing does not depend on them)."""
    from models.quantization import QuantizedWeight  # noqa: PLC0415
    if fmt in ("float32", "bfloat16"):
        return jnp.asarray(rng.standard_normal((num_layers, k, n), np.float32) / np.sqrt(k), fmt)
    kind, _, group = fmt.partition("-g")
    group = int(group) if group else k
    if k % group:
        group = k
    dtype, lo, hi = {"int8": (jnp.int8, -128, 128), "int4": (jnp.int4, -8, 8), "uint4": (jnp.uint4, 0, 16)}[kind]
    values = jnp.asarray(rng.integers(lo, hi, (num_layers, k, n), dtype=np.int8 if kind != "uint4" else np.uint8))
    scales = jnp.asarray(rng.uniform(1e-3, 1e-2, (num_layers, k // group, n)), jnp.float32)
    offsets = None if kind == "int8" else jnp.asarray(rng.uniform(-1e-2, 1e-2, scales.shape), jnp.float32)
    return QuantizedWeight(values.astype(dtype), scales, offsets)


def packed_bytes(packed) -> int:
    """Bytes of one layer of a packed stack (all its leaves)."""
    return sum(leaf.nbytes // leaf.shape[0] for leaf in jax.tree.leaves(packed))


def formats_table(args, rng):
    """--formats: the weight formats side by side on this CPU's own path."""
    print(f"formats: {', '.join(args.formats)} ({library.cpu_flags() & {'avx512f', 'avx2'} or 'portable'}); "
          f"ms per layer, median of {args.runs} calls; GB/s: a layer's packed weight bytes over its time")
    print(f"{'rows':>5}  {'linear':<8} {'K':>6} {'N':>6}  {'format':<10} {'ms':>9} {'GB/s':>7} {'GFLOP/s':>8} "
          f"{'vs f32':>7}")
    results = []
    for name, (k, n, num_layers, gated) in linears(args).items():
        if args.linears and name not in args.linears:
            continue
        groups = 2 if gated else 1
        steps, sizes = {}, {}
        for fmt in args.formats:
            packed = native.pack_stacked(weight_stack(rng, fmt, num_layers, k, n), groups)
            sizes[fmt] = packed_bytes(packed)

            def step(x, packed=packed, n=n, num_layers=num_layers, gated=gated, groups=groups):
                return [native.stacked_matmul(x, packed, layer, n=n, groups=groups, gated=gated)
                        for layer in range(num_layers)]
            steps[fmt] = jax.jit(step)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            fns = [on_path("default", steps[fmt]) for fmt in args.formats]
            times = time_side_by_side(fns, (x,), warmup=args.warmup, runs=args.runs)
            base = dict(zip(args.formats, times)).get("float32", (None,))[0]
            for fmt, (median_ms, min_ms) in zip(args.formats, times):
                per_layer = median_ms / num_layers
                gb_per_s = sizes[fmt] / per_layer / 1e6
                speedup = base / median_ms if base else float("nan")
                print(f"{m:>5}  {name:<8} {k:>6} {n:>6}  {fmt:<10} {per_layer:>9.3f} {gb_per_s:>7.1f} "
                      f"{2.0 * m * k * n / per_layer / 1e6:>8.1f} {speedup:>6.2f}x", flush=True)
                results.append({"rows": m, "linear": name, "k": k, "n": n, "layers": num_layers, "format": fmt,
                                "median_ms": per_layer, "min_ms": min_ms / num_layers, "bytes": sizes[fmt],
                                "gb_per_s": gb_per_s, "speedup_vs_float32": speedup})
        del steps
    return results


def on_path(name, fn):
    """fn with PATHS[name]'s switches set around each call."""
    def call(*a):
        saved = {k: os.environ.pop(k, None) for env in PATHS.values() for k in env}
        os.environ.update(PATHS[name])
        try:
            return jax.block_until_ready(fn(*a))
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--q_heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--formats", nargs="+",
                        help="time these weight formats side by side instead (float32 bfloat16 int8 int4-g32 ...)")
    parser.add_argument("--linears", nargs="+", choices=["qkv", "o", "gate_up", "down", "lm_head"],
                        help="only these linears (--formats)")
    add_common_flags(parser, warmup=2, runs=12)
    args = parser.parse_args()
    if not library.available():
        raise SystemExit(f"native library unavailable: {library.unavailable_reason()}")
    if args.formats:
        results = formats_table(args, np.random.default_rng(args.seed))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"config": vars(args), "cpu": platform.processor() or platform.machine(),
                           "cpu_flags": sorted(f for f in library.cpu_flags() if f.startswith(("avx", "fma"))),
                           "formats": results}, f, indent=1)
            print(f"wrote {args.json_out}")
        return
    dtype = jnp.dtype(args.dtype)
    paths = paths_here(library.cpu_flags())
    rng = np.random.default_rng(args.seed)
    results = []
    print(f"paths: {', '.join(paths)}; {args.dtype} weights; ms per layer, median of {args.runs} calls")
    print(f"{'rows':>5}  {'linear':<8}" + "".join(f"  {p + ' ms':>12}  {'GFLOP/s':>8}" for p in paths)
          + "  max_abs_diff")
    for name, (k, n, num_layers, gated) in linears(args).items():
        w = jnp.asarray(rng.standard_normal((num_layers, k, n), np.float32) / np.sqrt(k), dtype)
        packed = native.pack_stacked(w, 2 if gated else 1)
        del w

        def step(x, packed=packed, n=n, num_layers=num_layers, gated=gated):
            return [native.stacked_matmul(x, packed, layer, n=n, groups=2 if gated else 1, gated=gated,
                                          dtype=dtype) for layer in range(num_layers)]
        step = jax.jit(step)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
            fns = [on_path(p, step) for p in paths]
            outs = [np.asarray(f(x)[-1].astype(jnp.float32)) for f in fns]
            diff = max(float(np.abs(o - outs[0]).max()) for o in outs)
            times = time_side_by_side(fns, (x,), warmup=args.warmup, runs=args.runs)
            flops = 2.0 * m * k * n
            row = {"rows": m, "linear": name, "k": k, "n": n, "layers": num_layers, "max_abs_diff": diff}
            line = f"{m:>5}  {name:<8}"
            for p, (median_ms, min_ms) in zip(paths, times):
                per_layer, best = median_ms / num_layers, min_ms / num_layers
                row[p] = {"median_ms": per_layer, "min_ms": best, "gflop_per_s": flops / per_layer / 1e6}
                line += f"  {per_layer:>12.3f}  {flops / per_layer / 1e6:>8.1f}"
            print(line + f"  {diff:.2g}", flush=True)
            results.append(row)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": vars(args), "paths": paths, "cpu": platform.processor() or platform.machine(),
                       "cpu_flags": sorted(f for f in library.cpu_flags() if f.startswith(("avx", "fma"))),
                       "results": results}, f, indent=1)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
