"""scripts/train_tiny.py at a tiny size: its checkpoint loads and serves, loss falls, reruns are bit-identical."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from engine.worker.packing import SeqSlice, StepLayout, bucket, pack
from engine.worker.step import model_step
from helpers.repo import ROOT as REPO_ROOT
from models.loading import load_model
from models.paged import init_kv_cache
from models.tokenizers.load import load_tokenizer
from pallas_kernels.kernels import Kernels

SCRIPT = REPO_ROOT / "scripts" / "train_tiny.py"
TINY = dict(steps=20, vocab=400, layers=1, hidden=64, heads=4, kv_heads=2, head_dim=16, seq_len=64,
            batch_size=8, max_docs=200, max_source_files=40, eval_every=10, warmup_steps=5, sample_tokens=8,
            seed=3)
REPORT_FIELDS = {
    "command_line", "seed", "steps", "wall_seconds", "train_seconds", "steps_per_second", "train_losses",
    "final_train_loss", "eval_curve", "held_out_loss", "held_out_perplexity", "uniform_perplexity",
    "unigram_perplexity", "vocab_size", "param_count", "model_config", "samples",
}


def _start(out_dir: Path) -> subprocess.Popen:
    args = [f"--out_dir={out_dir}"] + [f"--{k}={v}" for k, v in TINY.items()]
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> None:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"train_tiny.py failed:\n{output[-5000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs with the same seed, side by side (each is mostly single-threaded at this size)."""
    dirs = [tmp_path_factory.mktemp(f"run{i}") for i in range(2)]
    procs = [_start(d) for d in dirs]
    for proc in procs:
        _finish(proc)
    return dirs


@pytest.fixture(scope="module")
def report(runs):
    return json.loads((runs[0] / "train_report.json").read_text())


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoint_and_tokenizer_load_with_expected_config(runs, report):
    loaded, tokenizer = load_model(str(runs[0])), load_tokenizer(str(runs[0]))
    cfg = loaded.cfg
    assert cfg.model_type == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (TINY["vocab"], TINY["hidden"], TINY["layers"])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (TINY["heads"], TINY["kv_heads"], TINY["head_dim"])
    assert cfg.max_position_embeddings == 2 * TINY["seq_len"] == loaded.max_model_len
    assert loaded.dtype == np.float32
    assert tokenizer.vocab_size == cfg.vocab_size
    assert tokenizer.bos_token_id == cfg.bos_token_id and tokenizer.eos_token_ids == cfg.eos_token_ids
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    text = "def f(x):\n    return  x  # ünïcode ✓\n"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id  # add_bos_token
    assert tokenizer.decode(ids) == text  # byte fallback and identity normalisation: exact round trip
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>user: hi\nassistant: "
    assert report["param_count"] == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(loaded.state))


def test_loss_falls(report):
    losses = report["train_losses"]
    assert len(losses) == TINY["steps"]
    assert losses[0] == pytest.approx(np.log(TINY["vocab"]), abs=0.5)  # starts near uniform
    assert losses[-1] < losses[0] - 0.5
    assert report["held_out_perplexity"] < report["uniform_perplexity"] == TINY["vocab"]


def test_report_has_every_field(report):
    assert REPORT_FIELDS <= set(report)
    assert report["seed"] == TINY["seed"] and report["steps"] == TINY["steps"]
    assert any(arg == f"--seed={TINY['seed']}" for arg in report["command_line"])
    assert report["held_out_perplexity"] == pytest.approx(np.exp(report["held_out_loss"]))
    assert [s["prompt"] for s in report["samples"]] == ["def", "The", "import"]
    for sample in report["samples"]:
        assert 1 <= len(sample["token_ids"]) <= TINY["sample_tokens"]
        assert isinstance(sample["completion"], str)


def test_same_seed_is_bit_identical(runs):
    first, second = (load_model(str(d)).params() for d in runs)
    def flat(tree):
        return dict(jax.tree_util.tree_leaves_with_path(tree))

    first, second = flat(first), flat(second)
    assert first.keys() == second.keys()
    for path, value in first.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(second[path]), err_msg=str(path))
    assert (runs[0] / "tokenizer.model").read_bytes() == (runs[1] / "tokenizer.model").read_bytes()
    losses = [json.loads((d / "train_report.json").read_text())["train_losses"] for d in runs]
    assert losses[0] == losses[1]


def test_training_forward_matches_paged_forward(runs, script):
    """The forward the script trains with and the paged one Ferry serves with are the same function."""
    loaded, tokenizer = load_model(str(runs[0])), load_tokenizer(str(runs[0]))
    prompt = tokenizer.encode("class Queue:\n    \"\"\"A FIFO queue.\"\"\"")[:40]
    trained = np.asarray(script.causal_lm_logits(nnx.merge(loaded.graphdef, loaded.state), np.array([prompt])))[0]
    block_size, pages = 16, bucket(len(prompt), 16) // 16
    cache = init_kv_cache(loaded.cfg.num_layers, 1 + pages, block_size, loaded.cfg.num_kv_heads,
                          loaded.cfg.head_dim, loaded.dtype)
    layout = StepLayout(bucket(len(prompt), 16), 1, pages, bucket(len(prompt), 16), decode=False)
    buf = pack([SeqSlice(prompt, 0, list(range(1, 1 + pages)))], layout, block_size, all_logits=True)
    paged, _ = model_step(loaded.graphdef, loaded.state, cache, buf, layout, Kernels.for_platform("cpu", loaded.dtype))
    paged = np.asarray(paged)[:len(prompt)]
    np.testing.assert_allclose(trained, paged, rtol=1e-4, atol=1e-4)
