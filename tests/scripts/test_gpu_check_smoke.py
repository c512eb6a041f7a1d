"""scripts/gpu_check.py and scripts/tpu_check.py --smoke run end to end on CPU (the Pallas / TPU
interpreters) and print their tables."""

import json
import os
import subprocess
import sys

import pytest

from helpers.repo import ROOT as REPO_ROOT

ROOT = str(REPO_ROOT)


@pytest.mark.parametrize("script", ["gpu_check.py", "tpu_check.py"])
def test_device_check_smoke(tmp_path, script):
    json_out = tmp_path / "check.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", script), "--smoke",
         "--json_out", str(json_out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for column in ("kernel", "shape", "kernel ms", "ref ms", "MB read", "GB/s", "% copy"):
        assert column in proc.stdout, output
    for case in ("decode mixed ctx", "decode split-K", "prefill behind prefix"):
        assert case in proc.stdout, output
    assert "copy bandwidth" in proc.stdout, output
    assert "all kernels match their references" in proc.stdout, output

    result = json.loads(json_out.read_text())
    assert result["all_ok"] and result["interpret"]
    if script == "gpu_check.py":  # the engine end to end and its decode trace, on a tiny model
        assert "engine end to end" in proc.stdout and "decode under jax.profiler" in proc.stdout, output
        engine = result["engine"]["tiny"]
        assert [r["batch"] for r in engine["rows"]] == [1, 4]
        assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in engine["rows"]), engine
        profile = engine["profile"]
        assert profile["kernels"] > 0 and 0 < profile["busy_pct"] <= 100, profile
    assert result["copy_gb_per_s"] > 0
    assert len(result["cases"]) == 3
    for case in result["cases"]:
        assert case["ok"] and case["kernel_ms"] > 0 and case["bytes_read"] > 0


def test_tpu_check_times_a_decode_step(tmp_path):
    """tpu_check.py --model: the engine's decode step of a model's shapes, timed beside its roofline (here through
    the TPU kernel in the interpreter)."""
    from scripts.test_aot_compile import write_config  # noqa: PLC0415

    model = write_config(tmp_path / "tiny", 4, 2, 32, layers=2, intermediate=128, vocab=256)
    json_out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "tpu_check.py"), "--smoke", f"--model={model}",
         "--max_num_seqs=4", "--max_model_len=64", "--json_out", str(json_out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode step, llama 2 layers, 4 x 64 tokens (pallas_tpu_interpret)" in proc.stdout, proc.stdout
    step = json.loads(json_out.read_text())["decode_step"]
    assert step["step_ms"] > 0 and step["roofline_ms"] > 0 and step["ideal_bytes"] > 0, step
