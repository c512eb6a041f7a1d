"""Micro-benchmark: a mixture of experts' grouped matmul, XLA's ragged_dot against the native grouped matmul.

    python scripts/bench_grouped_matmul.py [--experts 8 64] [--pairs 1 16 256] [--json_out results.json]

A MoE layer's two expert projections, gate/up (hidden -> 2 x expert width, SiLU-gated) and down (expert width ->
hidden), over --pairs (token, expert) pairs routed top --top_k among --experts experts, their rows sorted by
expert. XLA: jax.lax.ragged_dot of the layer's [E, K, N] taken from a [L, E, K, N] stack by a dynamic slice, as
the layer scan takes it (then the gated activation), which XLA CPU runs as a dense dot over all E groups after
copying the layer. Native: native.grouped_matmul over the stack packed once (pack_stacked of [L * E, K, N]),
the layer's experts read in place, one expert's rows at a time through its panels. ms per call (median of
time_side_by_side's blocks), the ratio XLA / native, and the largest difference between the two.
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
from pallas_kernels.ops import gated_activation


def routed_group_sizes(rng, pairs: int, experts: int, top_k: int):
    """group_sizes [E] of `pairs` (token, expert) pairs: tokens each routed to top_k distinct experts."""
    tokens = -(-pairs // top_k)
    chosen = np.stack([rng.choice(experts, min(top_k, experts), replace=False) for _ in range(tokens)])
    return jnp.asarray(np.bincount(chosen.reshape(-1)[:pairs], minlength=experts), jnp.int32)


def projections(args) -> dict[str, tuple[int, int, str | None]]:
    """name -> (K, N, gated activation)."""
    return {"gate_up": (args.hidden, 2 * args.expert_width, "silu"),
            "down": (args.expert_width, args.hidden, None)}


def xla_fn(gated, dtype):
    """ragged_dot of the layer's experts sliced from the stack (the scan's dynamic slice), then the activation."""
    def fn(x, sizes, stack, packed, first, layer):
        del packed, first
        w = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False)
        y = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
        return y if gated is None else gated_activation(y, dtype, gated)
    return jax.jit(fn)


def native_fn(n, gated, dtype):
    def fn(x, sizes, stack, packed, first, layer):
        del stack, layer
        return native.grouped_matmul(x, packed, first, sizes, n=n, groups=2 if gated else 1, gated=gated,
                                     dtype=dtype)
    return jax.jit(fn)


def bench_one(args, rng, experts, name, k, n, gated):
    """Rows of the table for one projection at `experts` experts: one per --pairs."""
    dtype = jnp.dtype(args.dtype)
    stack = jnp.asarray(rng.standard_normal((args.layers, experts, k, n)) / np.sqrt(k), dtype)
    packed = native.pack_stacked(stack.reshape(args.layers * experts, k, n), 2 if gated else 1)
    layer = args.layers - 1
    fns = [xla_fn(gated, dtype), native_fn(n, gated, dtype)]
    rows = []
    for pairs in args.pairs:
        x = jnp.asarray(rng.standard_normal((pairs, k)), dtype)
        sizes = routed_group_sizes(rng, pairs, experts, args.top_k)
        call_args = (x, sizes, stack, packed, jnp.int32(layer * experts), jnp.int32(layer))
        ref, out = (np.asarray(f(*call_args).astype(jnp.float32)) for f in fns)
        (xla_ms, _), (native_ms, _) = time_side_by_side(fns, call_args, warmup=args.warmup, runs=args.runs)
        rows.append(dict(experts=experts, projection=name, pairs=pairs, k=k, n=n, xla_ms=xla_ms,
                         native_ms=native_ms, speedup=xla_ms / native_ms,
                         max_abs_diff=float(np.abs(out - ref).max())))
        r = rows[-1]
        print(f"{experts:>7} {name:>8} {pairs:>6} {xla_ms:>10.3f} {native_ms:>10.3f} {r['speedup']:>8.2f} "
              f"{r['max_abs_diff']:>10.2e}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--pairs", type=int, nargs="+", default=[1, 16, 256], help="(token, expert) pairs: M")
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert_width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2, help="layers in the stack (the last one is timed)")
    add_common_flags(parser, warmup=3, runs=20)
    args = parser.parse_args()
    if not library.available():
        raise SystemExit(f"the native library is unavailable: {library.unavailable_reason()}")
    rng = np.random.default_rng(args.seed)
    print(f"{args.dtype}, hidden {args.hidden}, expert width {args.expert_width}, top-{args.top_k}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"{'experts':>7} {'proj':>8} {'pairs':>6} {'xla_ms':>10} {'native_ms':>10} {'xla/nat':>8} {'max_diff':>10}")
    results = []
    for experts in args.experts:
        for name, (k, n, gated) in projections(args).items():
            results += bench_one(args, rng, experts, name, k, n, gated)
    if args.json_out:
        report = dict(dtype=args.dtype, hidden=args.hidden, expert_width=args.expert_width, top_k=args.top_k,
                      layers=args.layers, cpus=os.cpu_count(), load=os.getloadavg()[0], machine=platform.machine(),
                      cpu_flags=sorted(library.cpu_flags() & {"avx2", "avx512f", "avx512_bf16"}), results=results)
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
