"""Micro-benchmark: native CPU paged decode attention (XLA FFI) vs the plain-jnp reference.

    python scripts/bench_native_attention.py [--json_out results.json]

Both run jitted, side by side in one process (blocks of calls taking turns: time_side_by_side), on the
same inputs: a batch of sequences of one context length each, pages handed out in shuffled order.
--layers=N gives each call N layers' caches, attended one after another as a model step does: past the
last-level cache, the pages then come from memory (one layer of 64 x 256 keys bf16, 8 MiB, stays in cache
between calls), and the KV GB/s column says how near the kernel runs to the machine's memory bandwidth
(this 2-core machine streams ~33 GB/s; 8 layers of 64 x 256 keys: bf16 19 GB/s, float32 24). Each timing
is the median of --runs calls (blocked until ready); the JSON also has the minimum.
FERRY_NATIVE_ATTENTION_THREADS=N sets the native kernel's threads (by default XLA's intra-op pool's).
"""

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native import library
from pallas_kernels.native import ops as native
from pallas_kernels.reference import paged_decode_attention_ref


def make_inputs(rng, *, batch, ctx, block_size, num_q_heads, num_kv_heads, head_dim, dtype, layers=1):
    """q, [k pages per layer], [v pages per layer], block tables, context lens."""
    pages_per_seq = -(-ctx // block_size)
    num_blocks = batch * pages_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(layers)]
    v = [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(layers)]
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = jnp.asarray(ids.reshape(batch, pages_per_seq))
    lens = jnp.full((batch,), ctx, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_dim), np.float32), dtype)
    return q, k, v, tables, lens


def layered(attention, scale):
    """q, [k], [v], tables, lens -> each layer's attention in turn, its output the next one's q (so none
    can be skipped or reordered)."""
    def run(q, ks, vs, tables, lens):
        for k, v in zip(ks, vs):
            q = attention(q, k, v, tables, lens, scale=scale).astype(q.dtype)
        return q
    return run


TIMING_BLOCKS = 4  # blocks of calls per fn (time_side_by_side)


def add_common_flags(parser, *, warmup, runs):
    """The native micro-benchmarks' shared flags: dtype, timing (time_side_by_side), seed and JSON."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed calls before each block of timed ones")
    parser.add_argument("--runs", type=int, default=runs,
                        help=f"timed calls per fn, rounded up to a multiple of {TIMING_BLOCKS} (the blocks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json_out", help="write the results here as JSON")


def time_side_by_side(fns, args, *, warmup, runs):
    """Per fn: (median ms, min ms). Each fn runs its calls in blocks, the blocks taking turns (a b b a
    ...), so slow drift of a shared machine hits the fns alike; a block starts with `warmup` untimed
    calls. Calls alternating one by one measured the native kernel at a fraction of its speed: after a call
    of the reference it runs slow for a few calls."""
    times = [[] for _ in fns]
    for b in range(TIMING_BLOCKS):
        for i in (range(len(fns)) if b % 2 == 0 else reversed(range(len(fns)))):
            for _ in range(warmup):
                jax.block_until_ready(fns[i](*args))
            for _ in range(-(-runs // TIMING_BLOCKS)):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[i](*args))
                times[i].append((time.perf_counter() - t0) * 1e3)
    return [(statistics.median(t), min(t)) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num_q_heads", type=int, default=8)
    parser.add_argument("--num_kv_heads", type=int, default=4)
    parser.add_argument("--head_dims", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1, help="KV caches per call, attended in turn")
    add_common_flags(parser, warmup=3, runs=20)
    args = parser.parse_args()

    if not library.available():
        raise SystemExit(f"native attention unavailable: {library.unavailable_reason()}")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    results = []
    header = (f"{'head_dim':>8} {'context':>8} {'reference ms':>13} {'native ms':>10} {'speedup':>8} "
              f"{'KV GB/s':>8}")
    print(f"decode, batch {args.batch}, {args.num_q_heads} q / {args.num_kv_heads} kv heads, "
          f"block {args.block_size}, {args.dtype}, {args.layers} layer(s) a call, "
          f"median of {-(-args.runs // TIMING_BLOCKS) * TIMING_BLOCKS} runs, "
          f"backend {jax.default_backend()}, native lib {library.library_path()}")
    print(header)
    print("-" * len(header))
    for head_dim in args.head_dims:
        scale = head_dim ** -0.5
        ref_fn = jax.jit(layered(paged_decode_attention_ref, scale))
        nat_fn = jax.jit(layered(native.paged_decode_attention_native, scale))
        for ctx in args.contexts:
            inputs = make_inputs(rng, batch=args.batch, ctx=ctx, block_size=args.block_size,
                                 num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                                 head_dim=head_dim, dtype=dtype, layers=args.layers)
            kv_bytes = 2 * args.layers * args.batch * ctx * args.num_kv_heads * head_dim * dtype.itemsize
            out_ref = np.asarray(ref_fn(*inputs), np.float32)
            out_nat = np.asarray(nat_fn(*inputs), np.float32)
            max_err = float(np.abs(out_ref - out_nat).max())
            (ref_ms, ref_min), (nat_ms, nat_min) = time_side_by_side(
                [ref_fn, nat_fn], inputs, warmup=args.warmup, runs=args.runs)
            row = dict(head_dim=head_dim, context=ctx, reference_ms=ref_ms, native_ms=nat_ms,
                       speedup=ref_ms / nat_ms, reference_min_ms=ref_min, native_min_ms=nat_min,
                       max_abs_err=max_err, layers=args.layers, native_kv_gb_per_s=kv_bytes / nat_ms / 1e6)
            results.append(row)
            print(f"{head_dim:>8} {ctx:>8} {ref_ms:>13.3f} {nat_ms:>10.3f} {ref_ms / nat_ms:>7.2f}x "
                  f"{row['native_kv_gb_per_s']:>8.1f}")
    if args.json_out:
        meta = dict(vars(args), machine=platform.machine(), cpu_count=os.cpu_count(),
                    jax=jax.__version__, threads_env=os.environ.get("FERRY_NATIVE_ATTENTION_THREADS"),
                    library=str(library.library_path()))
        with open(args.json_out, "w") as f:
            json.dump(dict(config=meta, results=results), f, indent=2)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
