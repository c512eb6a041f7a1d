"""Tensor- and data-parallel runs on forced CPU devices, for tests/engine/test_parallel.py (which compares what
this writes against transformers): XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before
jax starts, so it runs in its own process.

    python tests/helpers/multidevice_driver.py JOB_JSON OUT_JSON
"""

import json
import re
import sys

import jax
import numpy as np

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def greedy(job, model_dir, **config):
    llm = LLM(model_dir, EngineConfig(**job["config"], **config))
    outs = llm.generate(job["prompts"], SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True),
                        use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def collectives(llm) -> dict:
    """{"decode"/"prefill": {op: [result shapes]}} of the compiled greedy step."""
    runner = llm.engine.runner
    out = {}
    layouts = runner.buckets.step_layouts()
    for name, layout in (("decode", layouts[0]), ("prefill", layouts[-1])):
        hlo = runner.compilation.compile_step(layout, "greedy").as_text()
        out[name] = {op: re.findall(rf"= \w+\[([\d,]*)\]\S* {op}\(", hlo)
                     for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")}
    return out


def placement(llm) -> dict:
    """Bytes of parameters and KV cache per device, and their totals."""
    def per_device(arrays):
        sizes = {}
        for a in arrays:
            for shard in a.addressable_shards:
                sizes[str(shard.device)] = sizes.get(str(shard.device), 0) + shard.data.nbytes
        return sizes

    params = jax.tree.leaves(llm.engine.runner.model.state)
    cache = llm.engine.runner.kv.pages
    return {"params_per_device": per_device(params), "params_total": sum(a.nbytes for a in params),
            "params_replicated": sum(a.nbytes for a in params if a.sharding.is_fully_replicated),
            "kv_per_device": per_device(cache), "kv_total": sum(a.nbytes for a in cache),
            "kv_shape": list(cache[0].shape), "num_kv_heads": llm.engine.model.cfg.num_kv_heads}


def tensor_parallel(job) -> dict:
    """Every model at every TP size; the inspected one's collectives and placement at TP > 1."""
    out = {"tp": {}, "hlo": {}, "placement": {}}
    for arch, model_dir in job["models"].items():
        for tp in job["tp_sizes"]:
            llm, tokens = greedy(job, model_dir, tensor_parallel_size=tp)
            out["tp"][f"{arch}/{tp}"] = tokens
            if arch == job["inspect_arch"] and tp > 1:
                out["hlo"][str(tp)] = collectives(llm)
                out["placement"][str(tp)] = placement(llm)
    return out


def preemption(job) -> dict:
    """TP 2 in a cache too small for the prompts at once, under each preemption mode."""
    out = {"preempt": {}}
    model_dir = job["models"][job["inspect_arch"]]
    for mode in ("swap", "recompute"):
        llm, tokens = greedy(job, model_dir, tensor_parallel_size=2, num_blocks=job["tight_num_blocks"],
                             preemption_mode=mode)
        out["preempt"][mode] = {"tokens": tokens, "preemptions": llm.engine.stats()["preemptions"]}
    return out


def data_parallel(job) -> dict:
    """A mixed greedy / seeded-sampling workload, one replica against two (of one and of two devices)."""
    out = {"dp": {}}
    model_dir = job["models"][job["inspect_arch"]]
    rng = np.random.default_rng(job["seed"])
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=int(rng.integers(1 << 30)),
                             max_tokens=int(rng.integers(4, job["max_tokens"])), ignore_eos=True)
              for i in range(len(job["dp_prompts"]))]
    for dp, tp in ((1, 1), (2, 1), (2, 2)):
        llm = LLM(model_dir, EngineConfig(**job["config"], data_parallel_size=dp, tensor_parallel_size=tp))
        outs = llm.generate(job["dp_prompts"], params, use_tqdm=False)
        stats = llm.engine.stats()
        out["dp"][f"{dp}x{tp}"] = {"tokens": [o.outputs[0].token_ids for o in outs],
                                   "replica_steps": [s["step"] for s in stats.get("replicas", [stats])],
                                   "replica_queries": [s["prefix_cache_requests"] for s in
                                                       stats.get("replicas", [stats])]}
    return out


def quantized(job) -> dict:
    """The inspected model quantized on load (int8 per channel, int4 in groups) at every TP size, and each
    TP 2 shard's bytes of the packed weights."""
    out = {"quantized": {}, "quantized_placement": {}}
    model_dir = job["models"][job["inspect_arch"]]
    for method, group in job["quantizations"]:
        for tp in job["tp_sizes"]:
            llm, tokens = greedy(job, model_dir, tensor_parallel_size=tp, quantization=method,
                                 quantization_group_size=group)
            out["quantized"][f"{method}/{tp}"] = tokens
            if tp == 2:
                out["quantized_placement"][method] = placement(llm)
    return out


def expert_parallel(job) -> dict:
    """Every MoE model with its experts split by units (tensor parallel) and whole (expert parallel) at each TP
    size; the inspected one under preemption at expert parallel 2, with its step's collectives and how its
    experts lie on the devices."""
    out = {"moe": {}, "moe_preempt": {}, "moe_hlo": {}, "moe_experts_per_device": {}}
    for arch, model_dir in job["moe_models"].items():
        for tp in job["tp_sizes"]:
            for ep in (False, True) if tp > 1 else (False,):
                llm, tokens = greedy(job, model_dir, tensor_parallel_size=tp, expert_parallel=ep)
                out["moe"][f"{arch}/{tp}/{'ep' if ep else 'tp'}"] = tokens
                if arch == job["moe_inspect_arch"] and tp == 2:
                    experts = llm.engine.runner.model.state["layers"]["mlp"]["experts"]["gate_up_proj"][...]
                    shards = [list(s.data.shape) for s in experts.addressable_shards]
                    out["moe_experts_per_device"][str(ep)] = {"shape": list(experts.shape), "shards": shards}
                    out["moe_hlo"][str(ep)] = collectives(llm)
    for mode in ("swap", "recompute"):
        llm, tokens = greedy(job, job["moe_models"][job["moe_inspect_arch"]], tensor_parallel_size=2,
                             expert_parallel=True, num_blocks=job["tight_num_blocks"], preemption_mode=mode)
        out["moe_preempt"][mode] = {"tokens": tokens, "preemptions": llm.engine.stats()["preemptions"]}
    return out


SECTIONS = {"tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel, "preemption": preemption,
            "data_parallel": data_parallel, "quantized": quantized}


def main(job_path, out_path):
    """Runs the job's "sections" (names in SECTIONS); the test runs two drivers side by side, on the
    machine's two cores (each is mostly single-threaded XLA compiles)."""
    job = json.load(open(job_path))
    out = {}
    for section in job["sections"]:
        out |= SECTIONS[section](job)
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
