#!/usr/bin/env python
"""Error and lowering tables for every paged-attention implementation, on this host (CPU is fine).

  python scripts/kernel_tables.py --json_out tables.json   # full tables (a few minutes on 2 cores)
  python scripts/kernel_tables.py --smoke                  # tiny shapes, one head shape (CI, < 1 min)

Prints three markdown tables and, with --json_out, writes them as JSON:
  1. errors: max abs and max rel error (max |out - ref| / max |ref|) against the plain-jnp
     reference of the same dtype, float32 and bfloat16, decode and chunked prefill, for every impl
     that runs on a CPU host: reference (itself: 0), native (C++ FFI), Pallas-Triton
     in Pallas interpret mode, the jax-triton kernel in Triton's interpreter, the TPU kernel in
     the TPU interpreter. Inputs as in the tests: shuffled block tables, NaN in unowned slots.
  2. lowering: jax.export for CUDA (Pallas-Triton) and TPU (Mosaic) from this host at the model
     head shapes (pallas_kernels/lowering.py), with the jax version in the title: run it once per
     environment (jax 0.10.2 and 0.11.2) to fill both columns.
  3. sm_80 / sm_89 / sm_90: the jax-triton kernel compiled by triton.compile with no GPU, every configuration
     of its tuned table and its variants (pallas_kernels/triton/gpu_compile.py): registers, spill bytes, shared
     memory against the architecture's, and the PTX's vector and scalar K/V loads.
An implementation whose package is missing here is listed with the reason, not dropped.
Exits 1 if any error exceeds the tests' tolerance or any lowering/compile fails.
"""

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from helpers.attention_cases import TOL, decode_inputs, prefill_batch, prefill_inputs  # noqa: E402
from pallas_kernels.attention import paged_attention  # noqa: E402
from pallas_kernels.lowering import MODEL_HEAD_SHAPES, TPU_CALL_TARGET, TRITON_CALL_TARGETS, export_for  # noqa: E402
from pallas_kernels.native import library  # noqa: E402
from pallas_kernels.native import ops as native  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ERROR_IMPLS = ("reference", "native", "pallas_interpret", "jax_triton_interpret",
               "pallas_tpu_interpret")
warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one head shape, sm_90 only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="GPU compiles at a time")
    p.add_argument("--json_out", default=None)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- errors


def _why_not(impl: str, dtype) -> str | None:
    """None if `impl` runs here for `dtype`, else the reason."""
    if impl == "native" and not (library.available() and native.supports(dtype, dtype)):
        return "n/a: not built" if not library.available() else "n/a: dtype unsupported"
    if impl == "jax_triton_interpret":
        for package in ("triton", "torch"):
            try:
                __import__(package)
            except ImportError:
                return f"n/a: {package} not installed"
    return None


def _run(impl, inputs, *, decode, scale, soft_cap):
    q, k, v, tables, lens, qsl = inputs
    if impl == "jax_triton_interpret":
        from pallas_kernels.triton.jax_triton import run_interpreted
        return run_interpreted(q, k, v, tables, lens, qsl, decode=decode, scale=scale,
                               soft_cap=soft_cap)
    return paged_attention(q, k, v, tables, lens, qsl, decode=decode, scale=scale,
                           soft_cap=soft_cap, impl=impl)


def error_rows(smoke: bool, seed: int) -> list[dict]:
    hq, hkv, d, bs = (4, 2, 32, 8) if smoke else (8, 2, 128, 16)
    combos = [(name, decode) for name in DTYPES for decode in (True, False)]
    if smoke:  # one pairing: the interpreters are slow (the TPU one ~20 s a call on 2 cores)
        combos = [("bfloat16", False)]
    rows = []
    for dtype_name, decode in combos:
        dtype = DTYPES[dtype_name]
        rng = np.random.default_rng(seed)
        if decode:
            ctx = [0, 1, bs + 1, 5 * bs + 3] if smoke else [0, 1, bs, bs + 1, 37 * bs + 5, 300]
            q, k, v, tables, lens = decode_inputs(rng, ctx, num_q_heads=hq, num_kv_heads=hkv,
                                                  head_dim=d, block_size=bs, dtype=dtype)
            inputs = (q, k, v, tables, lens, None)
        else:
            prefixes, chunks = zip(*prefill_batch(bs))
            inputs = prefill_inputs(rng, prefixes, chunks, num_padding=3, num_q_heads=hq,
                                    num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype)
        kw = dict(decode=decode, scale=d ** -0.5, soft_cap=30.0)
        ref = np.asarray(_run("reference", inputs, **kw), np.float32)
        ref_max = float(np.abs(ref).max())
        for impl in ERROR_IMPLS:
            row = dict(impl=impl, dtype=dtype_name, mode="decode" if decode else "prefill",
                       shape=f"Hq={hq} Hkv={hkv} D={d} bs={bs}")
            reason = _why_not(impl, dtype)
            if reason:
                rows.append({**row, "status": reason})
                continue
            t0 = time.perf_counter()
            out = np.asarray(_run(impl, inputs, **kw), np.float32)
            abs_err = float(np.abs(out - ref).max()) if np.isfinite(out).all() else float("inf")
            rel_err = abs_err / ref_max
            ok = rel_err <= TOL[dtype]
            rows.append({**row, "status": "ok" if ok else "MISMATCH", "max_abs_err": abs_err,
                         "max_rel_err": rel_err, "seconds": time.perf_counter() - t0})
    return rows


# ----------------------------------------------------------------------------- lowering


def _specs(hq, hkv, d, decode):
    num_blocks, block_size, num_seqs, width, num_tokens = 512, 16, 8, 64, 256
    cache = jax.ShapeDtypeStruct((num_blocks, block_size, hkv, d), jnp.bfloat16)
    return (jax.ShapeDtypeStruct((num_seqs if decode else num_tokens, hq, d), jnp.bfloat16),
            cache, cache, jax.ShapeDtypeStruct((num_seqs, width), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def lowering_rows(shapes) -> list[dict]:
    targets = {"cuda": ("pallas", TRITON_CALL_TARGETS), "tpu": ("pallas_tpu", (TPU_CALL_TARGET,))}
    rows = []
    for name in shapes:
        hq, hkv, d = MODEL_HEAD_SHAPES[name]
        for decode in (True, False):
            for platform, (impl, calls) in targets.items():
                def f(*a, impl=impl, decode=decode, d=d):
                    return paged_attention(*a, decode=decode, scale=d ** -0.5, impl=impl)
                t0 = time.perf_counter()
                try:
                    text = export_for(platform, f, _specs(hq, hkv, d, decode))
                    found = [c for c in calls if c in text]
                    status = f"ok ({found[0]})" if found else "FAIL: no kernel custom call"
                except Exception as e:  # noqa: BLE001  (reported in the table)
                    status = "FAIL: " + _first_line(e)
                rows.append(dict(shape=name, heads=f"{hq}/{hkv}x{d}", platform=platform,
                                 mode="decode" if decode else "prefill", status=status,
                                 seconds=time.perf_counter() - t0))
    return rows


def compile_rows(smoke: bool, workers: int) -> list[dict]:
    """The jax-triton kernel's compile / spill / vector-load rows (pallas_kernels/triton/gpu_compile.py): every
    configuration of its tuned table and its variants; --smoke: sm_90 bfloat16 head_dim 128, 16-token pages."""
    try:
        from pallas_kernels.triton import gpu_compile
    except ImportError as e:
        return [dict(case="*", status=f"n/a: {_first_line(e)}")]
    cases = gpu_compile.table_cases()
    if smoke:
        plain = [c for c in cases if not (c.soft_cap or c.has_sinks or c.kv_dtype or c.num_splits > 1)]
        cases = [c for c in plain
                 if (c.compute_capability, c.dtype, c.head_dim, c.block_size) == (90, "bfloat16", 128, 16)]
    rows = []
    for row in gpu_compile.check_cases(cases, workers=workers):
        problems = gpu_compile.passes(row)
        rows.append({**row, "status": "ok" if not problems else "FAIL: " + "; ".join(problems)})
    return rows


# ----------------------------------------------------------------------------- output


def print_tables(errors, lowering, compiles):
    print(f"\n### Errors vs the reference (jax {jax.__version__})\n")
    print("| impl | dtype | mode | shape | max abs err | max rel err | status |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in errors:
        if "max_abs_err" in r:
            errs = f"{r['max_abs_err']:.2e} | {r['max_rel_err']:.2e}"
        else:
            errs = "- | -"
        print(f"| {r['impl']} | {r['dtype']} | {r['mode']} | {r['shape']} | {errs} | {r['status']} |")
    print(f"\n### Lowering from a CPU host (jax {jax.__version__}, bfloat16)\n")
    print("| shape | heads (q/kv x dim) | mode | cuda (Pallas-Triton) | tpu (Mosaic) |")
    print("| --- | --- | --- | --- | --- |")
    by_key = {(r["shape"], r["mode"], r["platform"]): r for r in lowering}
    for r in lowering:
        if r["platform"] == "cuda":
            tpu = by_key[(r["shape"], r["mode"], "tpu")]["status"]
            print(f"| {r['shape']} | {r['heads']} | {r['mode']} | {r['status']} | {tpu} |")
    print("\n### jax-triton kernel compiled without a GPU (triton.compile as triton_call would, ptxas -v)\n")
    print("| configuration | keys | q rows | warps | stages | registers | spill stores | shared KB (limit) "
          "| vector loads | scalar K/V loads | status |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in compiles:
        if "registers" not in r:
            print(f"| {r['case']} | | | | | | | | | | {r['status']} |")
            continue
        rows = r["block_q"] * (r["num_q_heads"] // r["num_kv_heads"])
        print(f"| {r['case']} | {r['tile_keys']} | {rows} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
              f"{r['spill_stores']} | {r['shared'] / 1024:.0f} ({r['shared_limit'] // 1024}) | {r['vector_loads']} | "
              f"{r['scalar_kv_loads']} | {r['status']} |")


def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    shapes = ["llama3-8b"] if args.smoke else list(MODEL_HEAD_SHAPES)
    errors = error_rows(args.smoke, args.seed)
    lowering = lowering_rows(shapes)
    compiles = compile_rows(args.smoke, args.workers)
    print_tables(errors, lowering, compiles)
    failed = [r for r in errors + lowering + compiles
              if not (r["status"].startswith("ok") or r["status"].startswith("n/a"))]
    print(f"\n{'all ok' if not failed else f'{len(failed)} FAILED'} "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(jax_version=jax.__version__, python=sys.version.split()[0],
                           smoke=args.smoke, seed=args.seed, errors=errors, lowering=lowering,
                           compile=compiles, all_ok=not failed), f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
