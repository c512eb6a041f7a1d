"""scripts/aot_compile.py: Ferry's step programs compiled for real TPU chips by libtpu's XLA and Mosaic compilers on
this CPU host (runs where libtpu is installed: the jax 0.11 environment, `make test-jax011`, installs it).

  * the compile table: one small model per attention head shape (head_dim 64, 80, 96, 128, 256; MHA, GQA, MQA),
    the largest decode and prefill programs and every swap copy, bf16, for v5e and v6e: every program compiles;
  * a decode step reads each weight in place: its temporaries stay under 2% of the weights (a per-layer copy of the
    stacked weights, as the CPU's optimization barrier makes, would be a whole layer's) and the KV cache is aliased
    to the output (donated, not copied);
  * a model whose block tables cannot fit SMEM is refused before anything compiles, naming the flags.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers.repo import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (the jax 0.11 environment has it: make test-jax011)")

# name: (num_q_heads, num_kv_heads, head_dim)
HEAD_SHAPES = {
    "d64-gqa": (9, 3, 64),      # SmolLM2-135M
    "d80-mha": (8, 8, 80),
    "d96-gqa": (12, 4, 96),
    "d128-gqa": (8, 2, 128),    # Llama 3 / Qwen2.5 grouping
    "d128-mha": (8, 8, 128),
    "d256-mqa": (8, 1, 256),    # Gemma-2B
}
CHIPS = ("v5e", "v6e")


def write_config(path, num_heads, num_kv_heads, head_dim, layers=2, intermediate=None, vocab=512):
    hidden = num_heads * head_dim
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "num_hidden_layers": layers,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False}))
    return path


def aot_compile(model_dir, tmp_path, *flags):
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "scripts/aot_compile.py", f"--model={model_dir}", f"--json_out={out}",
                           "--samplers=greedy", *flags], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("shape", list(HEAD_SHAPES))
def test_compile_table(shape, chip, tmp_path):
    model = write_config(tmp_path / shape, *HEAD_SHAPES[shape])
    proc, report = aot_compile(model, tmp_path, f"--topology={chip}:1x1", "--programs=largest", "--no_costs",
                               "--max_num_seqs=16", "--max_model_len=512", "--max_num_batched_tokens=128")
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [(p["program"], p["error"]) for p in report["programs"] if p["status"] != "ok"]
    assert not failed and proc.returncode == 0, failed
    names = [p["program"] for p in report["programs"]]
    assert any(n.startswith("decode") for n in names) and any(n.startswith("prefill") for n in names)
    assert any(n.startswith("swap-in") for n in names), names
    summary = report["summary"]
    assert summary["attention"] == "pallas_tpu" and summary["kv_cache_shape"][-1] % 128 == 0, summary


@pytest.mark.parametrize("block_size", [32, 256])
def test_page_sizes(block_size, tmp_path):
    """Pages of 32 and 256 tokens (16 is the table's default): a K/V block is then many small pages or one big one."""
    model = write_config(tmp_path / "m", *HEAD_SHAPES["d128-gqa"])
    proc, report = aot_compile(model, tmp_path, "--topology=v6e:1x1", "--programs=largest", "--no_costs",
                               f"--block_size={block_size}", "--max_num_seqs=16", "--max_model_len=1024",
                               "--max_num_batched_tokens=128")
    assert proc.returncode == 0 and report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["summary"]["kv_cache_shape"][2] == block_size


def test_decode_reads_weights_in_place(tmp_path):
    """A 4-layer GQA model (~0.1 GB of bf16 weights): the decode step's temporaries are under 2% of the weights
    (one layer's copy would be 25%) and the KV cache is aliased. (XLA's bytes accessed is in the report, not
    checked here: at these small shapes it counts a weight MSA keeps in VMEM once per re-read, 5x for an
    [8, 1024] x [1024, 8192] dot alone.)"""
    model = write_config(tmp_path / "m", 16, 4, 64, layers=4, intermediate=4096, vocab=4096)
    proc, report = aot_compile(model, tmp_path, "--topology=v6e:1x1", "--programs=decode", "--max_num_seqs=8",
                               "--max_model_len=1024", "--no_costs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = report["summary"]
    largest = [p for p in report["programs"] if p["program"].startswith("decode")][-1]
    assert largest["program"] == "decode b8 greedy", largest
    weights = summary["weights_bytes_per_device"]
    assert largest["temp_bytes"] < 0.02 * weights, (largest, weights)
    assert largest["alias_bytes"] >= summary["kv_cache_bytes_per_device"], largest


def test_smem_overflow_names_the_flags(tmp_path):
    model = write_config(tmp_path / "m", 8, 2, 128)
    proc, report = aot_compile(model, tmp_path, "--topology=v6e:1x1", "--programs=largest", "--max_num_seqs=256",
                               "--max_model_len=4096", "--block_size=4")
    assert proc.returncode != 0 and report is None
    assert "SMEM" in proc.stderr and "--block_size" in proc.stderr and "--max_model_len" in proc.stderr, \
        proc.stderr[-2000:]
