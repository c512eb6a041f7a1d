"""Smoke runs of the small benchmark scripts at tiny sizes: they run, print their table, write their JSON."""

import json
import os
import subprocess
import sys

from helpers.repo import ROOT as REPO_ROOT

ROOT = str(REPO_ROOT)


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "FERRY_COMPILATION_CACHE": "0"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_benchmark_batch(tmp_path):
    out = tmp_path / "batch.json"
    stdout = _run(["scripts/benchmark_batch.py", "--batches=1,4", "--prompt_len=8", "--output_len=6", "--layers=1",
                   "--hidden=64", "--vocab=256", "--block_size=8", f"--json_out={out}"], tmp_path)
    assert "host %" in stdout
    rows = json.load(open(out))["results"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["output_tokens"] == r["batch"] * 6 and r["tokens_per_s"] > 0
        assert 0 < r["host_share"] < 1 and 0 < r["device_share"] < 1


def test_benchmark_host(tmp_path):
    out = tmp_path / "host.json"
    stdout = _run(["scripts/benchmark_host.py", "--cases=4x64,8x40", "--steps=3", "--device_ms=1",
                   f"--json_out={out}"], tmp_path)
    assert "pipelined step ms" in stdout
    rows = json.load(open(out))["results"]
    assert [(r["batch"], r["context"]) for r in rows] == [(4, 64), (8, 40)]
    for r in rows:
        ms = r["median_ms"]
        assert ms["runner"] >= 1.0 and ms["core"] > 0 and ms["step"] > 0 and ms["pipelined step"] >= 1.0


def test_bench_native_attention(tmp_path):
    out = tmp_path / "native.json"
    stdout = _run(["scripts/bench_native_attention.py", "--batch=2", "--head_dims", "32", "--contexts", "16", "40",
                   "--layers=2", "--runs=2", "--warmup=1", "--json_out", str(out)], tmp_path)
    assert "native" in stdout and "KV GB/s" in stdout
    rows = json.load(open(out))["results"]
    assert [(r["head_dim"], r["context"], r["layers"]) for r in rows] == [(32, 16, 2), (32, 40, 2)]
    for r in rows:  # the second layer attends with the first one's output: an error would carry on
        assert r["native_ms"] > 0 and r["reference_ms"] > 0 and r["max_abs_err"] < 1e-5
        assert r["native_kv_gb_per_s"] > 0


def test_bench_native_matmul(tmp_path):
    """Every linear at two row counts through each path this CPU has; float32 x: the same bits on every
    path (the gate within float32 rounding: the AVX-512 one is its own code)."""
    out = tmp_path / "matmul.json"
    stdout = _run(["scripts/bench_native_matmul.py", "--rows", "1", "7", "--hidden=32", "--intermediate=72",
                   "--q_heads=2", "--kv_heads=1", "--head_dim=16", "--vocab=100", "--layers=2", "--runs=2",
                   "--warmup=1", "--json_out", str(out)], tmp_path)
    assert "GFLOP/s" in stdout
    report = json.load(open(out))
    assert report["paths"][0] == "default" and report["paths"][-1] == "portable"
    rows = report["results"]
    assert [(r["linear"], r["rows"]) for r in rows] == [
        (name, m) for name in ("qkv", "o", "gate_up", "down", "lm_head") for m in (1, 7)]
    for r in rows:
        assert r["max_abs_diff"] <= (1e-5 if r["linear"] == "gate_up" else 0.0), r
        assert all(r[p]["median_ms"] > 0 and r[p]["gflop_per_s"] > 0 for p in report["paths"])


def test_bench_grouped_matmul(tmp_path):
    """Both projections at two expert counts and two pair counts: the table, the JSON, XLA's ragged_dot and the
    native grouped matmul agreeing."""
    out = tmp_path / "grouped.json"
    stdout = _run(["scripts/bench_grouped_matmul.py", "--experts", "2", "5", "--pairs", "1", "9", "--hidden=32",
                   "--expert_width=40", "--runs=2", "--warmup=1", "--json_out", str(out)], tmp_path)
    assert "xla/nat" in stdout
    rows = json.load(open(out))["results"]
    assert [(r["experts"], r["projection"], r["pairs"]) for r in rows] == [
        (e, name, m) for e in (2, 5) for name in ("gate_up", "down") for m in (1, 9)]
    for r in rows:
        assert r["max_abs_diff"] <= 1e-4 and r["xla_ms"] > 0 and r["native_ms"] > 0, r


def test_benchmark_startup(tmp_path):
    """Two depths of a tiny model: the table, the JSON, and the same program count for both (scan)."""
    out = tmp_path / "startup.json"
    stdout = _run(["scripts/benchmark_startup.py", "--layers=1,3", "--hidden=32", "--heads=4", "--kv_heads=2",
                   "--vocab=128", "--max_model_len=32", "--max_num_seqs=2", "--max_num_batched_tokens=16",
                   "--num_blocks=8", f"--json_out={out}"], tmp_path)
    assert "warm-up s" in stdout
    rows = json.load(open(out))["warmup"]
    assert [r["layers"] for r in rows] == [1, 3]
    assert rows[0]["compiled_programs"] > 0 and rows[1]["compiled_programs"] <= rows[0]["compiled_programs"]
    assert all(r["warmup_s"] > 0 for r in rows)


def test_kernel_tables(tmp_path):
    """Every impl's error row, the CUDA/TPU lowering rows and the sm_90 compile rows, all ok."""
    out = tmp_path / "tables.json"
    stdout = _run(["scripts/kernel_tables.py", "--smoke", f"--json_out={out}"], tmp_path)
    for title in ("Errors vs the reference", "Lowering from a CPU host", "compiled without a GPU"):
        assert title in stdout, stdout
    result = json.load(open(out))
    assert result["all_ok"]
    impls = {(r["impl"], r["dtype"], r["mode"]) for r in result["errors"]}
    for impl in ("reference", "native", "pallas_interpret", "jax_triton_interpret",
                 "pallas_tpu_interpret"):
        assert (impl, "bfloat16", "prefill") in impls
    for r in result["errors"]:
        assert r["status"] == "ok" and r["max_rel_err"] < 2e-2, r
    assert result["errors"][0]["max_abs_err"] == 0  # the reference against itself
    assert {(r["platform"], r["mode"]) for r in result["lowering"]} == {
        (p, m) for p in ("cuda", "tpu") for m in ("decode", "prefill")}
    assert [(r["decode"], r["status"]) for r in result["compile"]] == [(True, "ok"), (False, "ok")]
    assert all(r["spill_stores"] == 0 and r["vector_loads"] > 0 for r in result["compile"])


def test_tune_triton_kernels(tmp_path):
    """One entry re-tuned from compiles: the same tiles as the table holds (the table is what the script writes)."""
    from pallas_kernels.triton import tuned_block_sizes as tuned  # noqa: PLC0415

    out = tmp_path / "tune.json"
    stdout = _run(["scripts/tune_triton_kernels.py", "--smoke", f"--json_out={out}"], tmp_path)
    assert "1/1 entries" in stdout, stdout
    (entry,) = json.load(open(out))["table"]
    key = (entry["arch"], entry["mode"], entry["dtype"], entry["head_dim"], entry["block_size"])
    assert tuned.TUNED[key] == tuned.BlockSizes(entry["rows"], entry["tile_keys"], entry["num_warps"],
                                                entry["num_stages"])


def test_benchmark_structured(tmp_path):
    from helpers.tokenizer_fixtures import write_byte_level_bpe_dir  # noqa: PLC0415

    (tmp_path / "tok").mkdir()
    tok_dir = write_byte_level_bpe_dir(tmp_path / "tok")
    out = tmp_path / "structured.json"
    stdout = _run(["scripts/benchmark_structured.py", f"--tokenizer={tok_dir}", "--batch=2", "--output_len=24",
                   "--layers=1", "--hidden=64", "--block_size=8", "--compile_repeats=2", "--nowarmup",
                   f"--json_out={out}"], tmp_path)
    assert "overhead" in stdout
    result = json.load(open(out))
    free, constrained = result["results"]
    assert not free["constrained"] and constrained["constrained"]
    assert free["output_tokens"] > 0 and constrained["output_tokens"] > 0 and constrained["tokens_per_s"] > 0
    assert result["compile"]["schema_compile_ms"] > 0


def test_kv_cache_usage(tmp_path):
    """A config-only checkpoint of two full and two sliding (window 32) layers: prefilling 512 tokens in 64-token
    chunks, the windows hold about half the blocks the same model holds without them, at the peak too."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, use_sliding_window=True,
        sliding_window=32, max_window_layers=2)))
    out = tmp_path / "usage.json"
    stdout = _run(["scripts/kv_cache_usage.py", f"--model={model}", "--context=512", "--chunk=64", "--decode=8",
                   "--block_size=16", f"--json_out={out}"], tmp_path)
    assert "prefilled GiB" in stdout
    windows, plain = json.load(open(out))
    assert (windows["groups"], windows["slots"], plain["groups"], plain["slots"]) == (2, 2, 1, 4)
    assert (plain["after_prefill_blocks"], plain["peak_blocks"]) == (512 // 16, 520 // 16 + 1)
    # 32 full-attention blocks + the sliding group's window (32 tokens: 2-3 blocks), each id 2 layers' pages; at
    # the peak also a chunk's (64 tokens: 4 blocks), or the decodes' one more full-attention block
    assert windows["after_prefill_blocks"] <= 32 + 3 and windows["peak_blocks"] <= 33 + 3 + 4
    assert windows["peak_gib"] < 0.6 * plain["peak_gib"]


def test_bench_quantization(tmp_path):
    """Every weight format of the packaged SmolLM2 GGUF at a tiny workload: the table, the JSON, the engine's
    weight bytes in the formats' order (float32 > bfloat16 > int8 > int4)."""
    out = tmp_path / "quant.json"
    stdout = _run(["scripts/bench_quantization.py", "--prompt_len=8", "--output_len=4", "--batch=2", "--rounds=1",
                   f"--json_out={out}"], tmp_path)
    assert "decode ms/tok" in stdout
    rows = json.load(open(out))["rows"]
    assert list(rows) == ["float32", "bfloat16", "int8", "int4", "gguf"]
    sizes = [rows[name]["weights_bytes"] for name in ("float32", "bfloat16", "int8", "int4")]
    assert sizes == sorted(sizes, reverse=True) and sizes[3] < sizes[0] / 4, sizes
    for r in rows.values():
        assert r["decode_ms_per_token"] > 0 and r["batch_tokens_per_s"] > 0
