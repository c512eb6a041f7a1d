"""Tensor parallel (TP 1/2/4), data parallel (2 replicas) and multi-host (2 processes) against transformers
and against one device. Forced CPU devices need XLA_FLAGS before jax starts, so the runs happen in child
processes (tests/helpers/multidevice_driver.py, tests/helpers/multihost_driver.py) and the assertions here."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.data_parallel import DataParallelEngine
from engine.entrypoints.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from helpers.hf_models import ARCHS, check_greedy_match, hf_greedy, load_weights_into, make_hf_model, make_text_model
from helpers.repo import ROOT as REPO_ROOT
from models.config import ModelConfig
from models.loading import load_model, quantize_model, random_model
from models.tokenizers.load import load_tokenizer

ROOT = str(REPO_ROOT)
CONFIG = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=128)
MAX_TOKENS = 12
TP_SIZES = (1, 2, 4)
INSPECT = "llama3"  # 4 query heads, 2 KV heads: TP 4 replicates each KV head twice
# plain experts; beside a gated shared expert; latent attention (its cache held whole by every device) with grouped
# routing and a dense first layer; sinks and expert biases
MOE_PARALLEL_ARCHS = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")
MOE_INSPECT = "deepseek_v3"
CHILD_TIMEOUT_S = 1200


def _env(**extra):
    return {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **extra}


def _fresh_seed():
    return int(np.random.SeedSequence().entropy % 2**31)


# The driver's sections, split over two processes that run side by side (the data-parallel runs compile both
# samplers' programs on every replica's devices: about as long as all the rest).
DRIVER_PARTS = (("tensor_parallel", "preemption", "quantized"), ("data_parallel", "expert_parallel"))
QUANTIZATIONS = (("int8", 32), ("int4", 32))  # (method, int4's group: 2 groups of the 64 hidden features)


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    """Every architecture at TP 1/2/4, forced preemption at TP 2, DP 2, in 4-device child processes."""
    seed = _fresh_seed()
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp("parallel")
    models = {arch: make_hf_model(arch, root / arch, seed=seed + i)
              for i, arch in enumerate(sorted(ARCHS) + list(MOE_PARALLEL_ARCHS))}
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (3, 17, 40)]
    job = {"models": {arch: str(root / arch) for arch in ARCHS}, "prompts": prompts,
           "moe_models": {arch: str(root / arch) for arch in MOE_PARALLEL_ARCHS},
           "moe_inspect_arch": MOE_INSPECT, "max_tokens": MAX_TOKENS,
           "config": CONFIG, "tp_sizes": TP_SIZES, "inspect_arch": INSPECT, "seed": seed,
           # 3 prompts of up to 52 tokens need 14 blocks of 8 at once; 9 usable ones force preemption
           "tight_num_blocks": 10, "quantizations": QUANTIZATIONS,
           "dp_prompts": [rng.integers(3, 384, size=int(rng.integers(3, 50))).tolist() for _ in range(10)]}
    env = _env(XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4")
    procs = []
    try:
        for i, sections in enumerate(DRIVER_PARTS):
            (root / f"job{i}.json").write_text(json.dumps({**job, "sections": sections}))
            procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers",
                                                                        "multidevice_driver.py"),
                                           str(root / f"job{i}.json"), str(root / f"out{i}.json")], env=env,
                                          stdout=open(root / f"driver{i}.log", "w"), stderr=subprocess.STDOUT))
        refs = {arch: [hf_greedy(model, p, MAX_TOKENS) for p in prompts] for arch, model in models.items()}
        for method, group in QUANTIZATIONS:  # transformers on the weights quantized on load, dequantized
            quantized = quantize_model(load_model(str(root / INSPECT)), method, group)
            load_weights_into(models[INSPECT], quantized)
            refs[f"{INSPECT}/{method}"] = [hf_greedy(models[INSPECT], p, MAX_TOKENS) for p in prompts]
        for i, proc in enumerate(procs):
            assert proc.wait(CHILD_TIMEOUT_S) == 0, (root / f"driver{i}.log").read_text()[-4000:]
    finally:
        for proc in procs:
            proc.kill()
    out = {}
    for i in range(len(DRIVER_PARTS)):
        out |= json.loads((root / f"out{i}.json").read_text())
    return seed, job, out, refs


def _check(tokens, refs, what):
    for ours, (ref, ref_logits) in zip(tokens, refs):
        tie = check_greedy_match(ours, ref, ref_logits)
        if tie:
            print(f"{what}: accepted {tie}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tensor_parallel_greedy_matches_transformers(parallel_run, arch):
    seed, _, out, refs = parallel_run
    for tp in TP_SIZES:
        _check(out["tp"][f"{arch}/{tp}"], refs[arch], f"{arch} TP {tp} (seed {seed})")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tensor_parallel_under_preemption_matches_transformers(parallel_run, mode):
    seed, _, out, refs = parallel_run
    run = out["preempt"][mode]
    assert run["preemptions"][mode] > 0, run["preemptions"]
    _check(run["tokens"], refs[INSPECT], f"TP 2 with {mode} preemption (seed {seed})")


@pytest.mark.parametrize("tp", [2, 4])
def test_step_has_the_expected_collectives_and_no_cache_gather(parallel_run, tp):
    """Row-parallel o_proj and down_proj all-reduce [tokens, hidden] inside the layer loop; the only
    all-gather is of the sampled rows' logits [rows, vocab]; nothing moves the KV cache between devices."""
    _, job, out, _ = parallel_run
    kv_shape = out["placement"][str(tp)]["kv_shape"]
    for phase, ops in out["hlo"][str(tp)].items():
        assert ops["all-reduce"], f"{phase}: no all-reduce"
        for shape in ops["all-reduce"]:
            assert shape.split(",")[-1] == "64", f"{phase}: all-reduce of [{shape}], expected [..., hidden 64]"
        for shape in ops["all-gather"]:
            dims = [int(d) for d in shape.split(",")]
            assert dims[-1] == 384 and len(dims) == 2, f"{phase}: all-gather of {dims}, expected [rows, vocab]"
            assert not set(dims) & {kv_shape[1], kv_shape[0] * kv_shape[1]}, f"{phase}: {dims} looks like the cache"
        assert not ops["all-to-all"] and not ops["reduce-scatter"], ops


@pytest.mark.parametrize("tp", [2, 4])
def test_each_device_holds_its_share_of_weights_and_cache(parallel_run, tp):
    place = parallel_run[2]["placement"][str(tp)]
    params, kv = place["params_per_device"], place["kv_per_device"]
    assert len(params) == len(kv) == tp
    sharded = place["params_total"] - place["params_replicated"]
    assert place["params_replicated"] < sharded / 4  # only norms are replicated
    for device, size in params.items():
        assert size == sharded // tp + place["params_replicated"], (device, size)
    for device, size in kv.items():
        assert size == place["kv_total"] // tp, (device, size)
    # TP 4 over 2 KV heads: each head twice, one per device
    assert place["num_kv_heads"] == max(2, tp) and place["kv_shape"][3] == max(2, tp)


@pytest.mark.parametrize("method", [m for m, _ in QUANTIZATIONS])
def test_quantized_weights_shard_and_match_transformers(parallel_run, method):
    """A model quantized on load at TP 1/2/4 against transformers on the same weights dequantized: the packed
    values, their scales and offsets split consistently; at TP 2 each device holds half of the sharded bytes."""
    seed, _, out, refs = parallel_run
    for tp in TP_SIZES:
        _check(out["quantized"][f"{method}/{tp}"], refs[f"{INSPECT}/{method}"], f"{method} TP {tp} (seed {seed})")
    place = out["quantized_placement"][method]
    sharded = place["params_total"] - place["params_replicated"]
    assert place["params_replicated"] < sharded / 4, place
    for device, size in place["params_per_device"].items():
        assert size == sharded // 2 + place["params_replicated"], (device, size)


@pytest.mark.parametrize("arch", MOE_PARALLEL_ARCHS)
def test_moe_expert_and_tensor_parallel_match_transformers(parallel_run, arch):
    seed, _, out, refs = parallel_run
    for tp in TP_SIZES:
        for layout in ("tp", "ep") if tp > 1 else ("tp",):
            _check(out["moe"][f"{arch}/{tp}/{layout}"], refs[arch],
                   f"{arch} TP {tp}, experts by {layout} (seed {seed})")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_expert_parallel_under_preemption_matches_transformers(parallel_run, mode):
    seed, _, out, refs = parallel_run
    run = out["moe_preempt"][mode]
    assert run["preemptions"][mode] > 0, run["preemptions"]
    _check(run["tokens"], refs[MOE_INSPECT], f"expert parallel 2 with {mode} preemption (seed {seed})")


def test_expert_parallel_holds_whole_experts_and_all_reduces_once_a_layer(parallel_run):
    """At 2 devices: expert parallel holds 4 whole experts a device, tensor parallel half of every expert's
    units; either way the step's collectives are all-reduces of [tokens, hidden] (attention's o_proj, the
    experts' and the shared expert's sums, the dense first layer's MLP) and the logits' all-gather: no
    all-to-all, no gathered weights or cache."""
    out = parallel_run[2]
    by_experts, by_units = out["moe_experts_per_device"]["True"], out["moe_experts_per_device"]["False"]
    layers, experts, hidden, units = by_experts["shape"]
    assert by_experts["shards"] == [[layers, experts // 2, hidden, units]] * 2
    assert by_units["shards"] == [[layers, experts, hidden, units // 2]] * 2
    for ep in ("True", "False"):
        for phase, ops in out["moe_hlo"][ep].items():
            assert ops["all-reduce"] and all(s.split(",")[-1] == "64" for s in ops["all-reduce"]), (ep, phase, ops)
            assert all(s.split(",")[-1] == "384" for s in ops["all-gather"]), (ep, phase, ops)
            assert not ops["all-to-all"] and not ops["reduce-scatter"], (ep, phase, ops)


def test_data_parallel_replicas_match_one_replica_and_share_the_work(parallel_run):
    dp = parallel_run[2]["dp"]
    assert dp["2x1"]["tokens"] == dp["1x1"]["tokens"]
    assert dp["2x2"]["tokens"] == dp["1x1"]["tokens"]
    for run in ("2x1", "2x2"):
        assert len(dp[run]["replica_steps"]) == 2 and min(dp[run]["replica_queries"]) >= 3, dp[run]


# ---------------------------------------------------------------- two processes on loopback

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _start(args, log_path):
    return subprocess.Popen([sys.executable, *args], env=_env(), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random llama with a real (byte-level BPE) tokenizer, prompts, and transformers' greedy outputs."""
    seed = _fresh_seed()
    model_dir, model = make_text_model(tmp_path_factory, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (5, 23)]
    return model_dir, prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def test_two_processes_tensor_parallel_offline(llama_dir, tmp_path):
    model_dir, prompts, refs = llama_dir
    job = {"config": CONFIG, "prompts": prompts, "max_tokens": MAX_TOKENS, "out": str(tmp_path / "out.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    port = _free_port()
    procs = [_start([os.path.join(ROOT, "tests", "helpers", "multihost_driver.py"), str(pid), str(port), model_dir,
                     str(tmp_path / "job.json")], tmp_path / f"p{pid}.log") for pid in (1, 0)]
    try:
        for p in procs:
            p.wait(CHILD_TIMEOUT_S / 2)
    finally:
        _kill(procs)
    logs = "\n".join((tmp_path / f"p{pid}.log").read_text()[-2000:] for pid in (0, 1))
    assert [p.returncode for p in procs] == [0, 0], logs
    _check(json.loads((tmp_path / "out.json").read_text())["tokens"], refs, "2 processes, TP 2")


def test_two_processes_serve_and_a_dead_follower_ends_the_job(llama_dir, tmp_path):
    model_dir, prompts, refs = llama_dir
    port, http_port = _free_port(), _free_port()
    common = ["-m", "engine.entrypoints.serve", f"--model={model_dir}", "--tensor_parallel_size=2", "--warmup=none",
              f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--distributed_timeout_s=20",
              *(f"--{k}={v}" for k, v in CONFIG.items())]
    follower = _start([*common, "--process_id=1"], tmp_path / "follower.log")
    leader = _start([*common, "--process_id=0", f"--port={http_port}"], tmp_path / "leader.log")
    procs = [leader, follower]
    try:
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + CHILD_TIMEOUT_S / 2
        while True:
            assert leader.poll() is None and time.monotonic() < deadline, (tmp_path / "leader.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        tokenizer = load_tokenizer(model_dir)
        for prompt, (ref, _) in zip(prompts, refs):
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": os.path.basename(model_dir), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "skip_special_tokens": False})
            assert r.status_code == 200, r.text
            # Text, not ids, comes back: a reference tie (top two within 1e-4) would show here as a mismatch.
            # Decoded after the prompt, as the engine's detokenizer does: new text starts where the prompt's text
            # and the whole text part (an output's first bytes may finish a prompt's incomplete character, whose
            # U+FFFD then becomes output; a U+FFFD that stays one is the prompt's).
            prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
            full_text = tokenizer.decode(prompt + ref, skip_special_tokens=False)
            expected = full_text[len(os.path.commonprefix([prompt_text, full_text])):]
            assert r.json()["choices"][0]["text"] == expected
        # A follower that dies ends the job with an error, not a hang.
        os.killpg(follower.pid, signal.SIGKILL)
        httpx.post(url + "/v1/completions", timeout=120, json={
            "model": os.path.basename(model_dir), "prompt": prompts[0], "max_tokens": 4})
        assert leader.wait(120) != 0
    except httpx.HTTPError:
        pass  # the leader went down mid-request: what the last step asserts
    finally:
        _kill(procs)
    assert leader.poll() not in (None, 0), (tmp_path / "leader.log").read_text()[-3000:]


def test_benchmark_parallel_smoke(tmp_path):
    """scripts/benchmark_parallel.py at a tiny size: one row per layout, every output complete, no compile
    after warm-up, and its JSON."""
    out = tmp_path / "parallel.json"
    tiny = ["--layers=1", "--hidden=64", "--heads=4", "--kv_heads=2", "--vocab=256", "--intermediate=128",
            "--num_prompts=6", "--prompt_len_range=4,16", "--output_len_range=4,12", "--repeats=1",
            "--max_num_seqs=4", "--max_num_batched_tokens=64", "--nosingle_request"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark_parallel.py"),
                           "--layouts=1x1,2x2", f"--json_out={out}", "--", *tiny], env=_env(), capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["layouts"]
    assert [(r["tp"], r["dp"]) for r in rows] == [(1, 1), (2, 2)]
    for row in rows:
        assert row["all_outputs_complete"] and row["compiles_after_warmup"] == 0, row
        assert row["median"]["output_tokens_per_s"] > 0
    assert "out tok/s" in proc.stdout


def test_data_parallel_routing_stats_and_metrics():
    """In process, two replicas sharing this process's one device: requests alternate between them (least
    loaded first), the totals are the replicas' sums, and /metrics has both the totals and each replica."""
    cfg = ModelConfig(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    device = jax.devices()[0]
    engine = DataParallelEngine(random_model(cfg), EngineConfig(block_size=8, max_num_seqs=4, num_blocks=24,
                                                                max_num_batched_tokens=32, data_parallel_size=2),
                                devices=[device, device])
    ids = [engine.add_request(None, list(range(3, 3 + n)), SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True)) for n in range(4, 10)]
    assert len(set(ids)) == 6 and [r.num_requests for r in engine.replicas] == [3, 3]
    engine.step()
    stats = engine.stats()
    assert [s["num_running"] for s in stats["replicas"]] == [3, 3] and stats["num_running"] == 6
    metrics = ServerMetrics("m")
    metrics.record_scheduler_stats(stats)
    text = metrics.render()[0].decode()
    assert 'ferry:num_requests_running{model_name="m"} 6.0' in text
    for replica in ("0", "1"):
        assert f'ferry:replica_num_requests_running{{model_name="m",replica="{replica}"}} 3.0' in text
    finished = set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == set(ids) and engine.num_requests == 0
    assert engine.stats()["num_running"] == 0


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_fused_columns_hand_each_shard_its_own_parts(groups):
    """A fused q/k/v kernel laid out for `groups` shards: shard s's contiguous column slice is exactly
    q, k and v's own s-th slices (its heads), and split_columns inverts fuse_columns."""
    from models.mesh import fuse_columns, split_columns

    rng = np.random.default_rng()
    widths = (32, 16, 16)
    parts = [rng.standard_normal((3, 8, w)).astype(np.float32) for w in widths]  # [layers, hidden, out]
    fused = np.asarray(fuse_columns(parts, groups))
    per_shard = sum(widths) // groups
    for s in range(groups):
        want = np.concatenate([p[..., s * w // groups:(s + 1) * w // groups] for p, w in zip(parts, widths)], -1)
        np.testing.assert_array_equal(fused[..., s * per_shard:(s + 1) * per_shard], want)
    for got, part in zip(split_columns(fused, widths, groups), parts):
        np.testing.assert_array_equal(np.asarray(got), part)
