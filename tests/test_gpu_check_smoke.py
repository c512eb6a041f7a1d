"""scripts/gpu_check.py --smoke runs end to end on CPU (interpret mode) and prints its table."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_smoke(tmp_path):
    json_out = tmp_path / "gpu_check.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--smoke",
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
