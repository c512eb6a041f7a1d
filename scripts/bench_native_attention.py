"""Micro-benchmark: native CPU paged decode attention (XLA FFI) vs the plain-jnp reference.

    python scripts/bench_native_attention.py [--json_out results.json]

Both run jitted, side by side in one process (calls alternate), on the same inputs: a batch of
sequences of one context length each, pages handed out in shuffled order. Each timing is the
median of --runs calls (blocked until ready) after --warmup calls; the JSON also has the minimum. FERRY_NATIVE_ATTENTION_THREADS=N caps the native
kernel's threads (it uses XLA's intra-op pool by default).
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

from pallas_kernels import native
from pallas_kernels.reference import paged_decode_attention_ref


def make_inputs(rng, *, batch, ctx, block_size, num_q_heads, num_kv_heads, head_dim, dtype):
    pages_per_seq = -(-ctx // block_size)
    num_blocks = batch * pages_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = jnp.asarray(ids.reshape(batch, pages_per_seq))
    lens = jnp.full((batch,), ctx, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_dim), np.float32), dtype)
    return q, k, v, tables, lens


def time_side_by_side(fns, args, *, warmup, runs):
    """Per fn: (median ms, min ms). Calls alternate between the fns, so load from other processes
    on a shared machine hits them alike."""
    for fn in fns:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append((time.perf_counter() - t0) * 1e3)
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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json_out", help="write the results here as JSON")
    args = parser.parse_args()

    if not native.available():
        raise SystemExit(f"native attention unavailable: {native.unavailable_reason()}")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    results = []
    header = f"{'head_dim':>8} {'context':>8} {'reference ms':>13} {'native ms':>10} {'speedup':>8}"
    print(f"decode, batch {args.batch}, {args.num_q_heads} q / {args.num_kv_heads} kv heads, "
          f"block {args.block_size}, {args.dtype}, median of {args.runs} runs, "
          f"backend {jax.default_backend()}, native lib {native.library_path()}")
    print(header)
    print("-" * len(header))
    for head_dim in args.head_dims:
        scale = head_dim ** -0.5
        ref_fn = jax.jit(lambda q, k, v, t, c, s=scale: paged_decode_attention_ref(
            q, k, v, t, c, scale=s))
        nat_fn = jax.jit(lambda q, k, v, t, c, s=scale: native.paged_decode_attention_native(
            q, k, v, t, c, scale=s))
        for ctx in args.contexts:
            inputs = make_inputs(rng, batch=args.batch, ctx=ctx, block_size=args.block_size,
                                 num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                                 head_dim=head_dim, dtype=dtype)
            out_ref = np.asarray(ref_fn(*inputs), np.float32)
            out_nat = np.asarray(nat_fn(*inputs), np.float32)
            max_err = float(np.abs(out_ref - out_nat).max())
            (ref_ms, ref_min), (nat_ms, nat_min) = time_side_by_side(
                [ref_fn, nat_fn], inputs, warmup=args.warmup, runs=args.runs)
            row = dict(head_dim=head_dim, context=ctx, reference_ms=ref_ms, native_ms=nat_ms,
                       speedup=ref_ms / nat_ms, reference_min_ms=ref_min, native_min_ms=nat_min,
                       max_abs_err=max_err)
            results.append(row)
            print(f"{head_dim:>8} {ctx:>8} {ref_ms:>13.3f} {nat_ms:>10.3f} {ref_ms / nat_ms:>7.2f}x")
    if args.json_out:
        meta = dict(vars(args), machine=platform.machine(), cpu_count=os.cpu_count(),
                    jax=jax.__version__, threads_env=os.environ.get("FERRY_NATIVE_ATTENTION_THREADS"),
                    library=str(native.library_path()))
        with open(args.json_out, "w") as f:
            json.dump(dict(config=meta, results=results), f, indent=2)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
