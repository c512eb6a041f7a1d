#!/usr/bin/env python
"""Check Ferry's paged-attention kernels on a GPU: correctness against the references, timing,
and bandwidth against the device's own copy bandwidth measured in the same run.

  python scripts/gpu_check.py                      # real sizes (H200: well under 5 minutes)
  python scripts/gpu_check.py --json_out out.json  # also write the results as JSON
  python scripts/gpu_check.py --smoke              # tiny shapes, interpret mode, any backend

Kernels: the Pallas-Triton decode and prefill kernels (paged_attention.py, prefill_attention.py),
then the same cases through the Triton-language kernel called by jax_triton.triton_call
(jax_triton_attention.py), when the `jax-triton` package imports here; otherwise its rows are
replaced by one line saying why (e.g. "jax-triton: not installed"), which does not fail the run.
On a jax without Pallas' Triton backend the Pallas rows are skipped the same way. --smoke skips
jax-triton (triton_call needs a GPU; tests/pallas_kernels/test_jax_triton.py checks the kernel on CPU).

Cases (defaults): decode with batch 64, 32 query / 8 KV heads, head_dim 128, bf16, block 16, at mixed contexts up to
4k, at 2k for all (the bandwidth target: >= 70% of the copy's) and at 4k for all; a small-batch long-context decode
(split-K); chunked prefill of 512-token chunks behind cached prefixes, and fresh 1k prompts. --smoke runs three of
them (mixed decode, split-K decode with 2 splits forced, prefill behind prefix). Every cache slot no sequence owns
is NaN (and unused block-table entries point at the NaN null block), so a kernel that reads past a context shows up
as a mismatch.

Engine runs (after the kernels; --engine_models, none with --no_engine): the whole engine (LLMEngine, its default
GPU attention kernel) on random-weight models of SmolLM2-135M's and Llama-3-8B's shapes (bfloat16): for each
--engine_batches batch, that many requests of --engine_prompt prompt tokens and --engine_output output tokens
(greedy, EOS ignored) submitted at once; prefill tok/s = prompt tokens / time until every request has its first
token, decode tok/s = the later tokens / the time after. Then a jax.profiler trace of --profile_steps decode steps
at batch 64 (the largest batch in --smoke) is read back (jax.profiler.ProfileData): how much of the traced window
the device was busy, and the gaps between its kernels longer than 50 us, where the device waited for the host.
--smoke runs a tiny Llama on whatever backend is here (the CPU: the XLA thread's ops stand for the device's
kernels).

Timing is device-synchronised: after a compile + warm-up call, each trial launches `--inner`
calls back to back and waits for the last with jax.block_until_ready; the median per-call time
over `--trials` trials is reported. "bytes read" is the least HBM traffic the op needs (each
attended K/V token once per KV head, plus q and the block tables); GB/s is that over the time,
and "% copy" compares it with a jitted 1 GiB device-to-device copy (read + write bytes / time).
Exits 1 if any kernel disagrees with its reference.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402
from pallas_kernels.triton.common import pallas_triton_available  # noqa: E402
from pallas_kernels.triton.decode import paged_decode_attention  # noqa: E402
from pallas_kernels.triton.prefill import paged_prefill_attention  # noqa: E402

TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes in Pallas interpret mode (CPU is fine); a few seconds")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--q_heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--max_context", type=int, default=4096)
    p.add_argument("--split_batch", type=int, default=4, help="batch of the split-K decode case")
    p.add_argument("--prefill_seqs", type=int, default=8)
    p.add_argument("--prefill_chunk", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    p.add_argument("--soft_cap", type=float, default=None)
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--inner", type=int, default=10, help="back-to-back calls per timed trial")
    p.add_argument("--copy_gib", type=float, default=1.0, help="size of the copy-bandwidth array")
    p.add_argument("--seed", type=int, default=None, help="default: fresh, printed")
    p.add_argument("--json_out", default=None)
    p.add_argument("--no_engine", action="store_true", help="the kernel table only")
    p.add_argument("--engine_models", default="smollm2-135m,llama3-8b", help=f"of {', '.join(ENGINE_MODELS)}")
    p.add_argument("--engine_batches", default="1,16,64,256")
    p.add_argument("--engine_prompt", type=int, default=512, help="prompt tokens a request")
    p.add_argument("--engine_output", type=int, default=128, help="output tokens a request")
    p.add_argument("--profile_steps", type=int, default=32)
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.q_heads, args.kv_heads, args.head_dim = 3, 4, 2, 32
        args.block_size, args.max_context, args.split_batch = 8, 40, 2
        args.prefill_seqs, args.prefill_chunk = 2, 6
        args.trials, args.inner, args.copy_gib = 3, 1, 1 / 128
        args.engine_models, args.engine_batches, args.engine_prompt, args.engine_output = "tiny", "1,4", 24, 6
        args.profile_steps = 4
    return args


# ----------------------------------------------------------------------------- inputs


def make_cache(rng, key, context_lens, *, block_size, num_kv_heads, head_dim, dtype):
    """Random K/V pages for the given contexts, shuffled block tables; unowned slots are NaN."""
    pages = [-(-int(c) // block_size) for c in context_lens]
    width = max(pages)
    num_blocks = 1 + sum(pages)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(pages), width), np.int32)  # unused entries -> null block 0 (NaN)
    valid = np.zeros((num_blocks, block_size), bool)
    start = 0
    for s, (ctx, n) in enumerate(zip(context_lens, pages)):
        own = ids[start:start + n]
        start += n
        tables[s, :n] = own
        valid[own] = True
        if n and ctx % block_size:
            valid[own[-1], ctx % block_size:] = False
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = _random_pages(key, jnp.asarray(valid), shape, jnp.dtype(dtype))
    return k, v, jnp.asarray(tables)


@jax.jit
def _nan_outside(x, valid):
    return jnp.where(valid[:, :, None, None], x, jnp.nan).astype(x.dtype)


def _random_pages(key, valid, shape, dtype):
    # Generated on the device: at real sizes each of K and V is ~0.5 GB.
    kk, kv = jax.random.split(key)
    return (_nan_outside(jax.random.normal(kk, shape, dtype), valid),
            _nan_outside(jax.random.normal(kv, shape, dtype), valid))


# ----------------------------------------------------------------------------- timing


def median_time(fn, *args, trials, inner):
    """Median seconds per call: compile + one warm-up excluded, device-synchronised."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def copy_bandwidth(gib, trials, inner):
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    n = int(gib * 2**30) // 4
    x = jnp.arange(n, dtype=jnp.uint32)
    copy = jax.jit(lambda a: a + jnp.uint32(1))  # one read + one write pass over the array
    t = median_time(copy, x, trials=trials, inner=inner)
    return 2 * x.nbytes / t / 1e9, t


# ----------------------------------------------------------------------------- cases


def triton_decode(interpret, num_splits=None):
    """make_kernel(scale, soft_cap) for the Pallas-Triton decode kernel."""
    return lambda scale, soft_cap: lambda *a: paged_decode_attention(
        *a, scale=scale, soft_cap=soft_cap, num_splits=num_splits, interpret=interpret)


def triton_prefill(interpret):
    return lambda scale, soft_cap: lambda *a: paged_prefill_attention(
        *a, scale=scale, soft_cap=soft_cap, interpret=interpret)


def jax_triton_unavailable() -> str | None:
    """None when the jax-triton kernel can run here, else why not (the GPU machine has no pip)."""
    try:
        import jax_triton  # noqa: F401, PLC0415  (imports triton too)
    except ImportError as e:
        return f"not installed ({str(e).splitlines()[0]})"
    return None


def jax_triton_kernel(decode: bool):
    """make_kernel(scale, soft_cap) for the jax-triton kernel (decode ignores the qsl slot)."""
    from pallas_kernels.triton.jax_triton import paged_attention_jax_triton  # noqa: PLC0415

    def make(scale, soft_cap):
        if decode:
            return lambda q, k, v, tables, lens: paged_attention_jax_triton(
                q, k, v, tables, lens, None, decode=True, scale=scale, soft_cap=soft_cap)
        return lambda *a: paged_attention_jax_triton(*a, decode=False, scale=scale,
                                                     soft_cap=soft_cap)
    return make


def decode_case(name, rng, key, args, batch, context_lens, make_kernel):
    """make_kernel(scale, soft_cap) -> f(q, k, v, tables, lens), checked and timed."""
    dtype = jnp.dtype(args.dtype)
    k, v, tables = make_cache(rng, key, context_lens, block_size=args.block_size,
                              num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype)
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, args.q_heads, args.head_dim), dtype)
    lens = jnp.asarray(context_lens, jnp.int32)
    scale = args.head_dim ** -0.5
    kernel = jax.jit(make_kernel(scale, args.soft_cap))
    ref = jax.jit(lambda *a: paged_decode_attention_ref(*a, scale=scale, soft_cap=args.soft_cap))
    operands = (q, k, v, tables, lens)
    itemsize = dtype.itemsize
    kv_bytes = 2 * int(np.sum(context_lens)) * args.kv_heads * args.head_dim * itemsize
    bytes_read = kv_bytes + q.nbytes + tables.nbytes + lens.nbytes
    flops = 4 * int(np.sum(context_lens)) * args.q_heads * args.head_dim
    shape = (f"B={batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
             f"bs={args.block_size} ctx<={max(context_lens)}")
    return run_case(name, shape, kernel, ref, operands, bytes_read, flops, args)


def prefill_case(name, rng, key, args, prefixes, chunks, make_kernel):
    """make_kernel(scale, soft_cap) -> f(q, k, v, tables, lens, qsl), checked and timed."""
    dtype = jnp.dtype(args.dtype)
    context_lens = [int(p + c) for p, c in zip(prefixes, chunks)]
    k, v, tables = make_cache(rng, key, context_lens, block_size=args.block_size,
                              num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype)
    num_tokens = int(np.sum(chunks))
    q = jax.random.normal(jax.random.fold_in(key, 1), (num_tokens, args.q_heads, args.head_dim),
                          dtype)
    lens = jnp.asarray(context_lens, jnp.int32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    scale = args.head_dim ** -0.5
    kernel = jax.jit(make_kernel(scale, args.soft_cap))
    ref = jax.jit(lambda *a: paged_prefill_attention_ref(*a, scale=scale, soft_cap=args.soft_cap))
    operands = (q, k, v, tables, lens, qsl)
    kv_bytes = 2 * int(np.sum(context_lens)) * args.kv_heads * args.head_dim * dtype.itemsize
    bytes_read = kv_bytes + q.nbytes + tables.nbytes
    # Causal: row i of a chunk behind `prefix` cached tokens attends to prefix + i + 1 keys.
    keys = sum(int(c) * int(p) + int(c) * (int(c) + 1) // 2 for p, c in zip(prefixes, chunks))
    flops = 4 * keys * args.q_heads * args.head_dim
    shape = (f"T={num_tokens} S={len(chunks)} Hq={args.q_heads} Hkv={args.kv_heads} "
             f"D={args.head_dim} bs={args.block_size} ctx<={max(context_lens)}")
    return run_case(name, shape, kernel, ref, operands, bytes_read, flops, args)


def run_case(name, shape, kernel, ref, operands, bytes_read, flops, args):
    out = np.asarray(jax.block_until_ready(kernel(*operands)), np.float32)
    expected = np.asarray(jax.block_until_ready(ref(*operands)), np.float32)
    scale = max(float(np.abs(expected).max()), 1e-6)
    finite = bool(np.isfinite(out).all())
    err = float(np.abs(out - expected).max()) / scale if finite else float("inf")
    ok = finite and err <= TOLERANCE[args.dtype]
    t_kernel = median_time(kernel, *operands, trials=args.trials, inner=args.inner)
    t_ref = median_time(ref, *operands, trials=args.trials, inner=args.inner)
    return dict(kernel=name, shape=shape, ok=ok, max_rel_err=err, kernel_ms=t_kernel * 1e3,
                reference_ms=t_ref * 1e3, speedup=t_ref / t_kernel, bytes_read=int(bytes_read),
                gb_per_s=bytes_read / t_kernel / 1e9, tflop_per_s=flops / t_kernel / 1e12)


# ----------------------------------------------------------------------------- the engine end to end

# Random-weight models of these shapes (bfloat16): name -> ModelConfig fields.
ENGINE_MODELS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16),
}


def engine_runs(args, seed) -> dict:
    """{model: {"attention": impl, "rows": [per batch], "profile": decode_profile}} (module docstring)."""
    from engine.config import EngineConfig  # noqa: PLC0415 (the kernel table needs none of the engine)
    from engine.llm_engine import LLMEngine  # noqa: PLC0415
    from models.config import ModelConfig  # noqa: PLC0415
    from models.loading import random_model  # noqa: PLC0415

    batches = [int(b) for b in args.engine_batches.split(",")]
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    results = {}
    for name in args.engine_models.split(","):
        cfg = ModelConfig(model_type="llama", max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
                          pad_token_id=0, **ENGINE_MODELS[name])
        model = random_model(cfg, dtype, seed)
        context = args.engine_prompt + args.engine_output
        engine = LLMEngine(model, EngineConfig(max_num_seqs=max(batches), max_model_len=context,
                                               max_num_batched_tokens=max(2048, args.engine_prompt),
                                               memory_fraction=0.8))
        t0 = time.perf_counter()
        engine.warmup(sampling=False)
        warmup_s = time.perf_counter() - t0
        rng = np.random.default_rng(seed)
        rows = [engine_batch(engine, rng, cfg.vocab_size, batch, args.engine_prompt, args.engine_output)
                for batch in batches]
        profile = decode_profile(engine, rng, cfg.vocab_size, min(64, max(batches)), args)
        results[name] = dict(attention=engine.runner.kernels.attention, warmup_s=warmup_s,
                             rows=rows, profile=profile)
        del engine, model
    return results


def _greedy(output_len):
    from engine.sampling_params import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def engine_batch(engine, rng, vocab, batch, prompt_len, output_len) -> dict:
    """`batch` requests at once: prefill tok/s until every one has its first token, decode tok/s after."""
    t0 = time.perf_counter()
    for _ in range(batch):
        engine.add_request(None, rng.integers(3, vocab, prompt_len).tolist(), _greedy(output_len))
    started, produced, t_first = set(), 0, None
    while engine.has_unfinished():
        for out in engine.step():
            produced += sum(len(o.token_ids) for o in out.outputs)
            started.add(out.request_id)
        if t_first is None and len(started) == batch:
            t_first, produced_first = time.perf_counter(), produced
    t_end = time.perf_counter()
    decode_tokens = produced - produced_first
    return dict(batch=batch, prompt=prompt_len, output=output_len, prefill_s=t_first - t0,
                prefill_tok_s=batch * prompt_len / (t_first - t0), decode_s=t_end - t_first,
                decode_tok_s=decode_tokens / (t_end - t_first) if t_end > t_first else float("nan"),
                decode_step_ms=1e3 * (t_end - t_first) / max(1, output_len - 1))


def decode_profile(engine, rng, vocab, batch, args) -> dict:
    """A jax.profiler trace of `args.profile_steps` decode steps at `batch`, summarised (device_gaps)."""
    import glob  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    for _ in range(batch):
        engine.add_request(None, rng.integers(3, vocab, 16).tolist(), _greedy(args.profile_steps + 8))
    for _ in range(4):  # past the prefill, into steady decode
        engine.step()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.profile_steps):
                engine.step()
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        summary = device_gaps(jax.profiler.ProfileData.from_file(path))
    while engine.has_unfinished():
        engine.step()
    return {**summary, "batch": batch, "steps": args.profile_steps}


def device_gaps(profile, min_gap_us: float = 50.0) -> dict:
    """How busy the device was over a trace: the union of its kernels' intervals (GPU: the "/device:GPU:N" planes'
    stream lines; without one, the host's XLA client thread, where the CPU runs the programs) against the window
    from the first to the last, and the idle gaps longer than `min_gap_us` (the device waiting for the host)."""
    intervals, source = [], None
    for plane in profile.planes:
        if plane.name.startswith("/device:GPU"):
            lines = [line for line in plane.lines if line.name.startswith("Stream")]
            source = "gpu"
        elif plane.name == "/host:CPU" and source is None:
            lines = [line for line in plane.lines if "XLAPjRtCpuClient" in line.name]
        else:
            continue
        for line in lines:
            intervals += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events if e.duration_ns > 0]
    if not intervals:
        return dict(source=source or "none", kernels=0)
    intervals.sort()
    busy, gaps = 0.0, []
    start, end = intervals[0]
    for s, e in intervals[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    window = end - intervals[0][0]
    long_gaps = [g / 1e3 for g in gaps if g / 1e3 > min_gap_us]
    return dict(source=source or "host-xla", kernels=len(intervals), window_ms=window / 1e6,
                busy_pct=100.0 * busy / window if window else 0.0, gaps_over_50us=len(long_gaps),
                largest_gap_us=max(long_gaps, default=0.0), gap_ms_total=sum(long_gaps) / 1e3)


def print_engine_tables(engine: dict) -> None:
    print("\nengine end to end (random weights, greedy, EOS ignored)")
    print(f"{'model':<14} {'attention':<11} {'batch':>5} {'prompt':>6} {'output':>6} {'prefill tok/s':>14} "
          f"{'decode tok/s':>13} {'decode ms/step':>15}")
    for name, result in engine.items():
        for r in result["rows"]:
            print(f"{name:<14} {result['attention']:<11} {r['batch']:>5} {r['prompt']:>6} {r['output']:>6} "
                  f"{r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.0f} {r['decode_step_ms']:>15.2f}")
    print("\ndecode under jax.profiler (device busy over the traced window; gaps: the device waiting)")
    for name, result in engine.items():
        p = result["profile"]
        if not p.get("kernels"):
            print(f"{name:<14} no device events in the trace ({p['source']})")
            continue
        print(f"{name:<14} batch {p['batch']}, {p['steps']} steps: {p['kernels']} kernels over {p['window_ms']:.1f} "
              f"ms, busy {p['busy_pct']:.1f}%, {p['gaps_over_50us']} gaps > 50 us (largest {p['largest_gap_us']:.0f} "
              f"us, {p['gap_ms_total']:.2f} ms in all) [{p['source']}]")


# ----------------------------------------------------------------------------- main


def print_table(rows, copy_gbs):
    header = (f"{'kernel':<33} {'shape':<52} {'kernel ms':>10} {'ref ms':>10} {'speedup':>8} "
              f"{'MB read':>9} {'GB/s':>8} {'% copy':>7} {'TFLOP/s':>8} {'rel err':>9} ok")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['kernel']:<33} {r['shape']:<52} {r['kernel_ms']:>10.4f} "
              f"{r['reference_ms']:>10.4f} {r['speedup']:>7.1f}x {r['bytes_read'] / 1e6:>9.2f} "
              f"{r['gb_per_s']:>8.1f} {r['pct_copy_bw']:>6.1f}% {r['tflop_per_s']:>8.3f} "
              f"{r['max_rel_err']:>9.2e} {'yes' if r['ok'] else 'NO'}")
    print(f"device-to-device copy bandwidth: {copy_gbs:.1f} GB/s (read + write)")


def main(argv=None):
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    interpret = args.smoke
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"seed {seed}, {'interpret mode' if interpret else 'Triton'}", flush=True)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    t_start = time.perf_counter()

    rows, skipped = [], {}
    copy_gbs, copy_s = copy_bandwidth(args.copy_gib, args.trials, args.inner)
    if pallas_triton_available():
        rows += run_cases(args, rng, key, decode_kernel=triton_decode(interpret),
                          split_kernel=triton_decode(interpret, 2 if interpret else None),
                          prefill_kernel=triton_prefill(interpret))
    else:
        skipped["pallas-triton"] = f"not in jax {jax.__version__}"
    why_not = "needs a GPU (--smoke)" if interpret else jax_triton_unavailable()
    if why_not is None:
        jt_rows = run_cases(args, rng, key, decode_kernel=jax_triton_kernel(True),
                            split_kernel=jax_triton_kernel(True),
                            prefill_kernel=jax_triton_kernel(False))
        rows += [{**r, "kernel": "jax-triton " + r["kernel"]} for r in jt_rows]
    else:
        skipped["jax-triton"] = why_not
    engine = {} if args.no_engine else engine_runs(args, seed)
    return report(args, rows, skipped, copy_gbs, copy_s, device, seed, interpret, t_start, engine)


def run_cases(args, rng, key, *, decode_kernel, split_kernel, prefill_kernel):
    """The cases (module docstring), each kernel given as make_kernel(scale, soft_cap); returns
    the result rows."""
    max_ctx = args.max_context
    rows = []
    mixed = rng.integers(1, max_ctx + 1, size=args.batch)
    rows.append(decode_case("decode mixed ctx", rng, jax.random.fold_in(key, 10), args,
                            args.batch, mixed, decode_kernel))
    if not args.smoke:
        rows.append(decode_case("decode 2k ctx", rng, jax.random.fold_in(key, 15), args,
                                args.batch, [min(2048, max_ctx)] * args.batch, decode_kernel))
        rows.append(decode_case("decode full ctx", rng, jax.random.fold_in(key, 11), args,
                                args.batch, [max_ctx] * args.batch, decode_kernel))
    # Few sequences: split-K on GPU (chosen automatically; forced in interpret mode).
    rows.append(decode_case("decode split-K", rng, jax.random.fold_in(key, 12), args,
                            args.split_batch, [max_ctx] * args.split_batch, split_kernel))
    chunk = args.prefill_chunk
    prefixes = rng.integers(0, max(1, max_ctx - chunk), size=args.prefill_seqs)
    rows.append(prefill_case("prefill behind prefix", rng, jax.random.fold_in(key, 13), args,
                             prefixes, [chunk] * args.prefill_seqs, prefill_kernel))
    if not args.smoke:
        fresh = max(1, args.prefill_seqs // 2)
        rows.append(prefill_case("prefill fresh prompts", rng, jax.random.fold_in(key, 14), args,
                                 [0] * fresh, [2 * chunk] * fresh, prefill_kernel))
    return rows


def report(args, rows, skipped, copy_gbs, copy_s, device, seed, interpret, t_start, engine=None):
    """Print the tables, write --json_out; exit status 0 when every kernel matched.
    skipped: {kernel family: why it did not run here}; engine: engine_runs' result (None: not run)."""
    for r in rows:
        r["pct_copy_bw"] = 100.0 * r["gb_per_s"] / copy_gbs
    print_table(rows, copy_gbs)
    for kernel, why in skipped.items():
        print(f"{kernel}: {why}")
    if engine:
        print_engine_tables(engine)
    elapsed = time.perf_counter() - t_start
    all_ok = bool(rows) and all(r["ok"] for r in rows)  # nothing checked is no pass
    print(f"{'all kernels match their references' if all_ok else 'MISMATCH'} "
          f"({elapsed:.1f} s)", flush=True)
    if args.json_out:
        result = dict(device=device.device_kind, backend=jax.default_backend(),
                      jax_version=jax.__version__, seed=seed, interpret=interpret,
                      args=vars(args), copy_gb_per_s=copy_gbs, copy_ms=copy_s * 1e3,
                      cases=rows, skipped=skipped, engine=engine, all_ok=all_ok, elapsed_s=elapsed)
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
