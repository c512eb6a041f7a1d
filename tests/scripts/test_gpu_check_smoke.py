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
    assert result["copy_gb_per_s"] > 0
    assert len(result["cases"]) == 3
    for case in result["cases"]:
        assert case["ok"] and case["kernel_ms"] > 0 and case["bytes_read"] > 0
