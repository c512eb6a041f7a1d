"""CPU speed of weight formats side by side: one request's decode and a batch of requests' throughput for a model in
float32, bfloat16, int8 and int4 (quantized on load) and as its GGUF file's own packed blocks, and, given
--llama_cpp_bin, llama.cpp (llama-bench, llama-batched-bench) on the same GGUF file at the same thread count.

    python scripts/bench_quantization.py [--model=smollm2] [--formats=float32,bfloat16,int8,int4,gguf]
        [--llama_cpp_bin=DIR] [--threads=2] [--rounds=3] [--json_out=results.json]

--model is a GGUF file (or a packaged model's short name): the float formats are its blocks dequantized, int8 and
int4 those floats quantized again by --quantization's path, "gguf" the file's blocks as Ferry serves them by
default. Per format, in turns (every format once a round, after a warm-up run of each):
  decode ms/token: one request of --prompt_len tokens, the time of --output_len + 1 tokens less that of 1 token
    (the prefill), over --output_len;
  batch tokens/s: --batch requests of --prompt_len tokens each generating --output_len, prompt + output tokens
    over the wall time (llama-batched-bench's S t/s).
Weight bytes are the engine's own accounting (LLMEngine.memory).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMATS = ("float32", "bfloat16", "int8", "int4", "gguf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a GGUF file, or a packaged model's short name")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--int4_group_size", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--llama_cpp_bin", default=None, help="a llama.cpp build's bin/ (llama-bench, llama-batched-bench)")
    p.add_argument("--json_out", default=None)
    return p.parse_args(argv)


def build_engines(args) -> dict:
    from engine.config import EngineConfig  # noqa: PLC0415
    from engine.entrypoints.cli_flags import resolve_model_dir  # noqa: PLC0415
    from engine.llm import LLM  # noqa: PLC0415
    from models.checkpoints import gguf  # noqa: PLC0415
    from models.loading import load_model, model_from_checkpoint, quantize_model  # noqa: PLC0415

    path = resolve_model_dir(args.model)
    blocks = 1 + args.batch * -(-(args.prompt_len + args.output_len + 1) // 16)
    config = dict(block_size=16, num_blocks=blocks, max_num_seqs=args.batch,
                  max_num_batched_tokens=max(512, args.prompt_len), enable_prefix_caching=False)
    engines = {}
    for name in args.formats.split(","):
        if name not in FORMATS:
            raise SystemExit(f"--formats: unknown {name!r}; expected {', '.join(FORMATS)}")
        if name == "gguf":
            model = load_model(path)
        else:
            model = model_from_checkpoint(gguf.read_checkpoint(path, dequantize=True),
                                          "bfloat16" if name == "bfloat16" else "float32")
            if name in ("int8", "int4"):
                model = quantize_model(model, name, args.int4_group_size)
        engines[name] = LLM(model, EngineConfig(**config))
        print(f"{name}: weights {engines[name].engine.memory['weight_bytes'] / 2**20:.1f} MiB", flush=True)
    return path, engines


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from engine.sampling_params import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def measure(llm, args, one, batch) -> dict:
    prefill_s = timed_generate(llm, [one], 1)
    whole_s = timed_generate(llm, [one], args.output_len + 1)
    batch_s = timed_generate(llm, batch, args.output_len)
    return {"decode_ms_per_token": 1e3 * (whole_s - prefill_s) / args.output_len,
            "batch_tokens_per_s": len(batch) * (args.prompt_len + args.output_len) / batch_s}


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def llama_cpp(args, path) -> dict:
    """llama-bench's tg (one stream's decode) and llama-batched-bench's S t/s at --batch streams."""
    bench = subprocess.run([os.path.join(args.llama_cpp_bin, "llama-bench"), "-m", path, "-t", str(args.threads),
                            "-p", "0", "-n", str(args.output_len), "-r", str(args.rounds), "-o", "json"],
                           capture_output=True, text=True, check=True)
    tg = json.loads(bench.stdout)[0]["avg_ts"]
    batched = subprocess.run([os.path.join(args.llama_cpp_bin, "llama-batched-bench"), "-m", path, "-t",
                              str(args.threads), "-c", str(args.batch * (args.prompt_len + args.output_len)),
                              "-b", "2048", "-ub", "512", "-npp", str(args.prompt_len), "-ntg", str(args.output_len),
                              "-npl", str(args.batch), "--output-format", "jsonl"],
                             capture_output=True, text=True, check=True)
    row = json.loads([line for line in batched.stdout.splitlines() if line.startswith("{")][-1])
    return {"decode_ms_per_token": 1e3 / tg, "batch_tokens_per_s": row["speed"], "weights_bytes": os.path.getsize(path)}


def main(argv=None):
    args = parse_args(argv)
    import numpy as np  # noqa: PLC0415

    path, engines = build_engines(args)
    rng = np.random.default_rng(0)
    vocab = next(iter(engines.values())).engine.model.cfg.vocab_size
    one = rng.integers(3, vocab, size=args.prompt_len).tolist()
    batch = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(args.batch)]
    for llm in engines.values():  # warm-up: every program the runs below take
        measure(llm, args, one, batch)
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            runs[name].append(measure(llm, args, one, batch))
    rows = {name: {"weights_bytes": engines[name].engine.memory["weight_bytes"],
                   **{key: median([r[key] for r in results]) for key in results[0]}}
            for name, results in runs.items()}
    if args.llama_cpp_bin:
        rows["llama.cpp (gguf)"] = llama_cpp(args, path)
    base = rows.get("float32")
    print(f"\n{os.path.basename(path)}, {args.threads} threads, {platform.processor() or platform.machine()}; "
          f"decode: 1 request, {args.prompt_len}-token prompt; batch: {args.batch} x ({args.prompt_len} + "
          f"{args.output_len}) tokens; medians of {args.rounds} rounds")
    print(f"{'weights':<18} {'MiB':>8} {'decode ms/tok':>14} {'tok/s':>8} {'x f32':>6} {'batch tok/s':>12}")
    for name, r in rows.items():
        speedup = base["decode_ms_per_token"] / r["decode_ms_per_token"] if base else float("nan")
        print(f"{name:<18} {r['weights_bytes'] / 2**20:>8.1f} {r['decode_ms_per_token']:>14.2f} "
              f"{1e3 / r['decode_ms_per_token']:>8.1f} {speedup:>6.2f} {r['batch_tokens_per_s']:>12.1f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": path, "threads": args.threads, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
