"""Offline throughput of Ferry against request-level batching and Hugging Face transformers (as
vLLM's `bench throughput`).

Every backend runs the same seeded workload on the same checkpoint, greedy with EOS ignored, so each
request generates exactly its output length:

  ferry          every request through LLMEngine's continuous batching at once (async scheduling, the
                 default: each decode step planned and dispatched before the last one's tokens are back).
  ferry-sync     the same with async scheduling off (EngineConfig.async_scheduling=False).
  ferry-nocache  the same with prefix caching off (--workload=shared_prefix or multi_turn: the gain).
  ferry-unrolled the same with the decoder layers unrolled (EngineConfig.scan_layers=False).
  ferry-kv-bf16  the same with a bfloat16 KV cache (EngineConfig.kv_dtype; under a float32 model).
  ferry@F=V[@F=V...]  the same with EngineConfig fields set (a Python literal, else a string), to A/B any
                 setting side by side: ferry@max_num_batched_tokens=2048, ferry@kv_dtype=bfloat16.
  ferry-static   the same engine fed --static_batch requests at a time; the next batch starts only
                 when all of the previous one are done (request-level batching, no joins mid-batch).
  transformers   `model.generate` on left-padded batches of --static_batch prompts, max_new_tokens =
                 the batch's longest output, EOS disabled; only each request's own output tokens
                 count. Torch uses --torch_threads (default: all cores).
  vllm           vLLM's offline `LLM.generate` on every request at once (token-id prompts, greedy,
                 ignore_eos), run by --vllm_python (a venv with vLLM, e.g. its CPU build) as a
                 subprocess (scripts/vllm_worker.py) that lives through every repeat. Warm-up is one
                 untimed pass over the whole workload. Skipped, with a warning, without --vllm_python.

Static batches are consecutive requests in workload order (random lengths, so each batch waits on
its longest member; --static_sort groups similar prompt lengths instead).

Backends are warmed up first (excluded from timing, reported), then interleaved round-robin over
--repeats, the order rotating (rep 1: a, b, c; rep 2: b, c, a; ...), so slow drift of the machine and
the place in the order (first, or last, of a repeat) hit all of them alike; the table quotes the median
of the repeats and the ratios between backends. Each timed run starts after --settle_s idle seconds: the vLLM
worker's threads, still busy after its own run, slowed the run after it (most of all Ferry's single request).
Warm-up times:
the second Ferry engine reuses the first one's in-process compilations, and LLMEngine's persistent
compilation cache makes any later launch's warm-up short (FERRY_COMPILATION_CACHE=0 for cold ones).

Per timed Ferry run it also records the XLA compilations (0 if warm-up covered every shape), the
host share of step time (scheduler + packing + postprocessing; the rest is the jitted call),
preemptions and the peak KV-cache usage (sampled after every step). The single-request row times one
request (--single_prompt_len / --single_output_len) alone on ferry and transformers: time to the
first token and ms per output token, from Ferry's first delta and a transformers streamer.

Workloads (--workload): "random" prompts; "shared_prefix": every prompt opens with one
--shared_prefix_len-token system prompt; "multi_turn": --num_prompts chats of --turns turns over that
system prompt, each later turn sent when the previous one finished and resending its whole history (its
prompt and answer) plus a new message (--prompt_len_range sets the messages). Ferry runs also report
the time to first token of every request (from its submission: for offline runs mostly queueing),
p50/p99, and the prefix-cache hit rate; each run starts from an empty prefix cache.

    python scripts/benchmark_throughput.py --workload=shared_prefix --compare=ferry,ferry-nocache \
        --num_prompts=64 --shared_prefix_len=1024 --prompt_len_range=16,64 --output_len_range=16,32

A random Llama (--layers/--hidden/...) is saved with transformers' save_pretrained when the
transformers backend is compared, and Ferry loads that same directory; otherwise Ferry builds it
directly. --model=DIR runs a Hugging Face (or, without transformers, a Ferry) checkpoint, --model=FILE.gguf
(or a packaged name: --model=smollm2) a GGUF file, which transformers loads with gguf_file=.

    python scripts/benchmark_throughput.py --compare=ferry,ferry-static,transformers --repeats=3 \
        --num_prompts=200 --json_out=throughput.json
"""

import ast
import dataclasses
import os
import tempfile
import time

import bench_common as bc
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from throughput_backends import Run, TransformersBackend, VllmBackend, single_metrics, static_batches

from engine.config import EngineConfig
from engine.data_parallel import make_engine
from engine.llm_engine import freeze_startup_heap
from engine.sampling_params import SamplingParams
from engine.worker.compilation import CompileCounter
from models.checkpoints.ferry import FERRY_CONFIG
from models.config import ModelConfig
from models.loading import LoadedModel, load_model, random_model

BACKENDS = ("ferry", "ferry-sync", "ferry-nocache", "ferry-unrolled", "ferry-kv-bf16", "ferry-static",
            "transformers", "vllm")
HF_BACKENDS = ("transformers", "vllm")  # these load the Hugging Face directory themselves
SINGLE_BACKENDS = ("ferry", "ferry-sync", "transformers", "vllm")
WORKLOADS = ("random", "shared_prefix", "multi_turn")

FLAGS = flags.FLAGS
# workload
flags.DEFINE_integer("num_prompts", 100, "requests in the workload")
flags.DEFINE_string("prompt_len_range", "32,512", "random prompt lengths: lo,hi (inclusive)")
flags.DEFINE_string("output_len_range", "32,256", "output lengths: lo,hi (inclusive)")
flags.DEFINE_string("dataset", None, 'JSONL of {"prompt": str, "output_len": int (optional)}; '
                    "needs --model with a tokenizer")
flags.DEFINE_integer("seed", 0, "workload and random-model seed")
flags.DEFINE_enum("workload", "random", WORKLOADS, "random prompts, prompts over one shared system prompt, "
                  "or multi-turn chats resending their history")
flags.DEFINE_integer("shared_prefix_len", 1024, "shared_prefix / multi_turn: system prompt tokens")
flags.DEFINE_integer("turns", 3, "multi_turn: turns per chat (--num_prompts chats)")
# model
flags.DEFINE_string("model", None, "checkpoint directory (Hugging Face or Ferry), .gguf file or packaged name "
                    "(smollm2); default: a random Llama")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "model dtype (both backends)")
flags.DEFINE_integer("layers", 4, "random model: layers")
flags.DEFINE_integer("hidden", 256, "random model: hidden size")
flags.DEFINE_integer("heads", 8, "random model: attention heads")
flags.DEFINE_integer("kv_heads", 4, "random model: key/value heads")
flags.DEFINE_integer("vocab", 32000, "random model: vocabulary size")
flags.DEFINE_integer("intermediate", 1024, "random model: MLP intermediate size (with --experts: each expert's)")
flags.DEFINE_integer("experts", 0, "random model: a Mixtral-style mixture of this many experts (0: a dense Llama)")
flags.DEFINE_integer("experts_per_tok", 2, "random model: experts each token is routed to (with --experts)")
# backends
flags.DEFINE_enum("backend", "ferry", BACKENDS, "the backend to run (without --compare)")
flags.DEFINE_list("compare", None, f"run several backends, interleaved: any of {','.join(BACKENDS)}, or "
                  "ferry@field=value[@field=value] (EngineConfig fields set)")
flags.DEFINE_integer("repeats", 3, "timed runs per backend (round-robin over the backends)")
flags.DEFINE_float("settle_s", 1.0, "idle seconds before each timed run, so the previous backend's trailing "
                   "work (a peer process's threads still spinning) does not land in the next one's time")
flags.DEFINE_integer("static_batch", 16, "requests per batch for ferry-static and transformers")
flags.DEFINE_bool("static_sort", False, "sort requests by prompt length before cutting static batches")
# Ferry engine
flags.DEFINE_integer("max_num_seqs", 64, "EngineConfig.max_num_seqs")
flags.DEFINE_integer("tensor_parallel_size", 1, "EngineConfig.tensor_parallel_size", lower_bound=1)
flags.DEFINE_integer("data_parallel_size", 1, "EngineConfig.data_parallel_size", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 512, "EngineConfig.max_num_batched_tokens")
flags.DEFINE_integer("block_size", 16, "EngineConfig.block_size")
flags.DEFINE_integer("num_blocks", None, "EngineConfig.num_blocks (default: from --memory_fraction)")
flags.DEFINE_float("memory_fraction", 0.5, "EngineConfig.memory_fraction")
flags.DEFINE_integer("chunk_size", None, "EngineConfig.chunk_size (prefill chunk cap)")
flags.DEFINE_integer("max_model_len", None, "EngineConfig.max_model_len (default: the longest request)")
flags.DEFINE_enum("kv_dtype", None, ["float32", "bfloat16", "float16", "int8", "fp8"],
                  "EngineConfig.kv_dtype (default: the model's dtype; bfloat16 under a float32 model halves the cache)")
# transformers
flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads; 0: all cores")
flags.DEFINE_string("torch_device", "cpu", "device for the transformers backend")
# vLLM
flags.DEFINE_string("vllm_python", None, "python of a venv with vLLM (e.g. /work/vllm-venv/bin/python); "
                    "without it the vllm backend is skipped")
flags.DEFINE_string("vllm_threads_bind", None, "VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N)")
flags.DEFINE_integer("vllm_kvcache_gib", 2, "VLLM_CPU_KVCACHE_SPACE (GiB)")
flags.DEFINE_integer("vllm_max_num_batched_tokens", None, "vLLM's max_num_batched_tokens (default: vLLM's)")
# single-request latency
flags.DEFINE_bool("single_request", True, "also time one request alone (ferry and transformers)")
flags.DEFINE_integer("single_prompt_len", 128, "single request: prompt tokens")
flags.DEFINE_integer("single_output_len", 128, "single request: output tokens")
flags.DEFINE_string("json_out", None, "write every result here")


def run_metrics(run: Run, requests: list[bc.BenchRequest]) -> dict:
    prompt_tokens = sum(bc.full_prompt_lens(requests))
    output_tokens = sum(run.produced)
    complete = all(p == r.output_len for p, r in zip(run.produced, requests))
    return {"elapsed_s": run.elapsed_s, "requests": len(requests), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "all_outputs_complete": complete,
            "requests_per_s": len(requests) / run.elapsed_s, "output_tokens_per_s": output_tokens / run.elapsed_s,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / run.elapsed_s, **run.extras}


def greedy_params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


# ------------------------------------------------------------------ Ferry

class FerryBackend:
    """LLMEngine, continuous (batch_size None: everything at once) or request-level batched."""

    def __init__(self, name: str, model: LoadedModel, config: EngineConfig, batch_size: int | None):
        self.name, self.batch_size = name, batch_size
        self.engine = make_engine(model, config)
        self._submitted: dict[str, tuple[int, float]] = {}  # engine request id -> (request index, submit time)

    def warmup(self) -> float:
        return self.engine.warmup(sampling=False)  # greedy only: the sampler this workload uses

    def run(self, requests: list[bc.BenchRequest]) -> Run:
        engine = self.engine
        if not engine.reset_prefix_cache():  # every run starts cold: no hits on the previous repeat's prompts
            raise RuntimeError("prefix cache still in use between runs")
        first_turns = [i for i, r in enumerate(requests) if r.follows is None]  # later turns: when answered
        batches = ([first_turns] if self.batch_size is None
                   else static_batches(requests, self.batch_size, FLAGS.static_sort))
        followers = {}
        for i, r in enumerate(requests):
            if r.follows is not None:
                followers.setdefault(r.follows, []).append(i)
        before = self._counters()
        produced, peak_kv, ttft = [0] * len(requests), 0.0, [None] * len(requests)
        histories: dict[int, list[int]] = {}  # request index -> its prompt + output so far, for the next turn
        t0 = time.perf_counter()
        for batch in batches:
            for i in batch:
                self._submit(requests, i, histories)
            while engine.has_unfinished():
                for delta in engine.step():
                    i, submitted = self._submitted[delta.request_id]
                    produced[i] += sum(len(o.token_ids) for o in delta.outputs)
                    histories[i] += delta.outputs[0].token_ids
                    if ttft[i] is None:
                        ttft[i] = time.perf_counter() - submitted
                    if delta.finished:
                        del self._submitted[delta.request_id]
                        for j in followers.get(i, []):  # the chat's next turn, now that its answer is in
                            self._submit(requests, j, histories)
                        histories.pop(i, None)
                peak_kv = max(peak_kv, engine.stats()["kv_usage"])
        elapsed = time.perf_counter() - t0
        return Run(elapsed, produced, self._extras(before, self._counters(), peak_kv) | {
            "ttft_ms_p50": 1e3 * bc.median(ttft), "ttft_ms_p99": 1e3 * bc.summarize(ttft)["p99"]})

    def _submit(self, requests: list[bc.BenchRequest], i: int, histories: dict[int, list[int]]) -> None:
        r = requests[i]
        prompt = (histories[r.follows] if r.follows is not None else []) + r.prompt_ids
        histories[i] = list(prompt)
        rid = self.engine.add_request(None, prompt, greedy_params(r.output_len))
        self._submitted[rid] = (i, time.perf_counter())

    def _counters(self) -> dict:
        engine = self.engine
        stats = engine.stats()
        return {**engine.timings, "compiles": CompileCounter.count,
                "preemptions": sum(stats["preemptions"].values()),
                "prefix_cache_queries": stats["prefix_cache_queries"],
                "prefix_cache_hits": stats["prefix_cache_hits"]}

    @staticmethod
    def _extras(before: dict, after: dict, peak_kv: float) -> dict:
        d = {k: after[k] - before[k] for k in after}
        step_s = d["schedule_s"] + d["execute_s"] + d["postprocess_s"] + d["outputs_s"]
        host_s = d["schedule_s"] + d["pack_s"] + d["postprocess_s"] + d["outputs_s"]  # execute's rest: the jitted call
        return {"steps": d["steps"], "planned_ahead": d["planned_ahead"], "compiles": d["compiles"],
                "preemptions": d["preemptions"],
                "prefix_cache_hits": d["prefix_cache_hits"],
                "prefix_cache_hit_rate": d["prefix_cache_hits"] / max(d["prefix_cache_queries"], 1),
                "peak_kv_usage": peak_kv, "step_ms_mean": 1e3 * step_s / max(d["steps"], 1),
                "host_share": host_s / step_s if step_s else None,
                "device_share": d["device_s"] / step_s if step_s else None}

    def single(self, prompt_ids: list[int], output_len: int) -> dict:
        """One request alone: first-token time and per-token time, from the engine's own deltas."""
        engine = self.engine
        t0 = time.perf_counter()
        engine.add_request(None, prompt_ids, greedy_params(output_len))
        first, produced = None, 0
        while engine.has_unfinished():
            for delta in engine.step():
                produced += sum(len(o.token_ids) for o in delta.outputs)
                if first is None and produced:
                    first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        return single_metrics(first, total, produced)


def available_backends(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the backends to run, {skipped backend: why}): vllm only with --vllm_python."""
    if "vllm" not in names:
        return names, {}
    if not FLAGS.vllm_python:
        logging.warning("skipping the vllm backend: no --vllm_python")
        return [n for n in names if n != "vllm"], {"vllm": "no --vllm_python"}
    if not os.path.exists(FLAGS.vllm_python):
        raise app.UsageError(f"--vllm_python={FLAGS.vllm_python}: no such file")
    return names, {}


# ------------------------------------------------------------------ model and workload

def random_model_config() -> ModelConfig:
    moe = dict(model_type="mixtral", num_experts=FLAGS.experts, num_experts_per_tok=FLAGS.experts_per_tok,
               moe_intermediate_size=FLAGS.intermediate, norm_topk_prob=True) if FLAGS.experts else {}
    return ModelConfig(**{"model_type": "llama", **moe}, vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden,
                       intermediate_size=FLAGS.intermediate, num_layers=FLAGS.layers, num_heads=FLAGS.heads,
                       num_kv_heads=FLAGS.kv_heads, head_dim=FLAGS.hidden // FLAGS.heads,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)


def save_random_hf_llama(out_dir: str) -> str:
    """The random Llama (with --experts: Mixtral) as a transformers checkpoint, so both backends load identical
    weights."""
    import torch
    import transformers

    moe = dict(num_local_experts=FLAGS.experts, num_experts_per_tok=FLAGS.experts_per_tok) if FLAGS.experts else {}
    config = (transformers.MixtralConfig if FLAGS.experts else transformers.LlamaConfig)(
        vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden, intermediate_size=FLAGS.intermediate,
        num_hidden_layers=FLAGS.layers, num_attention_heads=FLAGS.heads, num_key_value_heads=FLAGS.kv_heads,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        **moe)
    torch.manual_seed(FLAGS.seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, FLAGS.dtype))
    model.save_pretrained(out_dir)
    return out_dir


def prepare_model(backends: list[str], scratch: str) -> tuple[LoadedModel, str | None, str]:
    """(Ferry's model, a Hugging Face directory for transformers and vLLM or None, where the model came from)."""
    hf_backends = sorted(set(backends) & set(HF_BACKENDS))
    if FLAGS.model:
        if hf_backends and os.path.exists(os.path.join(FLAGS.model, FERRY_CONFIG)):
            raise app.UsageError(f"the {hf_backends} backends need a Hugging Face checkpoint, not a Ferry one")
        model = load_model(FLAGS.model, FLAGS.dtype)  # a directory, a .gguf file or a packaged name (smollm2)
        if "vllm" in backends and model.path.endswith(".gguf"):
            raise app.UsageError("the vllm backend takes a Hugging Face directory for --model, not a .gguf file")
        return model, model.path, model.path
    if hf_backends:
        hf_dir = save_random_hf_llama(os.path.join(scratch, "random_llama"))
        return load_model(hf_dir, FLAGS.dtype), hf_dir, "random llama (save_pretrained)"
    return random_model(random_model_config(), jnp.dtype(FLAGS.dtype), FLAGS.seed), None, "random llama (ferry)"


def build_workload(model: LoadedModel) -> list[bc.BenchRequest]:
    output_range = bc.parse_int_range(FLAGS.output_len_range)
    if FLAGS.dataset:
        if model.path is None:
            raise app.UsageError("--dataset needs --model=DIR with a tokenizer")
        from models.tokenizers.load import load_tokenizer
        tokenizer = load_tokenizer(model.path)
        return bc.dataset_requests(bc.read_jsonl_prompts(FLAGS.dataset, FLAGS.num_prompts), tokenizer.encode,
                                   output_range, FLAGS.seed)
    prompt_range, vocab = bc.parse_int_range(FLAGS.prompt_len_range), model.cfg.vocab_size
    if FLAGS.workload == "shared_prefix":
        return bc.shared_prefix_requests(FLAGS.num_prompts, FLAGS.shared_prefix_len, prompt_range, output_range,
                                         vocab, FLAGS.seed)
    if FLAGS.workload == "multi_turn":
        return bc.multi_turn_requests(FLAGS.num_prompts, FLAGS.turns, FLAGS.shared_prefix_len, prompt_range,
                                      output_range, vocab, FLAGS.seed)
    return bc.random_token_requests(FLAGS.num_prompts, prompt_range, output_range, vocab, FLAGS.seed)


def single_request_prompt(vocab_size: int) -> list[int]:
    return np.random.default_rng(FLAGS.seed + 1).integers(0, vocab_size, FLAGS.single_prompt_len).tolist()


def engine_config(requests: list[bc.BenchRequest]) -> EngineConfig:
    longest = max(p + r.output_len for p, r in zip(bc.full_prompt_lens(requests), requests))
    if FLAGS.single_request:
        longest = max(longest, FLAGS.single_prompt_len + FLAGS.single_output_len)
    return EngineConfig(block_size=FLAGS.block_size, num_blocks=FLAGS.num_blocks,
                        memory_fraction=FLAGS.memory_fraction, max_num_seqs=FLAGS.max_num_seqs,
                        max_num_batched_tokens=FLAGS.max_num_batched_tokens, chunk_size=FLAGS.chunk_size,
                        max_model_len=FLAGS.max_model_len or longest,
                        tensor_parallel_size=FLAGS.tensor_parallel_size, data_parallel_size=FLAGS.data_parallel_size,
                        kv_dtype=FLAGS.kv_dtype)


# The named Ferry variants: each is the engine under other EngineConfig settings, as ferry@field=value spells
# any other.
FERRY_VARIANTS = {"ferry": "", "ferry-sync": "async_scheduling=False", "ferry-nocache": "enable_prefix_caching=False",
                  "ferry-unrolled": "scan_layers=False", "ferry-kv-bf16": "kv_dtype=bfloat16"}


def is_variant(name: str) -> bool:
    return name in FERRY_VARIANTS or name.startswith("ferry@")


def config_variant(name: str, config: EngineConfig) -> EngineConfig:
    """A Ferry variant's name -> `config` with its EngineConfig fields replaced: a name of FERRY_VARIANTS, or
    "ferry@field=value@..." with each value a Python literal (2048, 0.5, False, None), else the string."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    settings = FERRY_VARIANTS.get(name, name.partition("@")[2])
    changes = {}
    for item in filter(None, settings.split("@")):
        field, eq, text = item.partition("=")
        if not eq or field not in fields:
            raise app.UsageError(f"{name}: each @ takes an EngineConfig field=value ({item!r}); fields: "
                                 f"{', '.join(sorted(fields))}")
        try:
            changes[field] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            changes[field] = text
    return dataclasses.replace(config, **changes)


def make_backend(name: str, model: LoadedModel, hf_dir: str | None, config: EngineConfig,
                 requests: list[bc.BenchRequest], scratch: str):
    if is_variant(name):
        return FerryBackend(name, model, config_variant(name, config), batch_size=None)
    if name == "ferry-static":
        return FerryBackend(name, model, config, batch_size=FLAGS.static_batch)
    if name == "vllm":
        backend = VllmBackend(FLAGS.vllm_python, hf_dir, FLAGS.dtype, max_model_len=config.max_model_len,
                              max_num_seqs=config.max_num_seqs, seed=FLAGS.seed, log_dir=scratch,
                              threads_bind=FLAGS.vllm_threads_bind, kvcache_gib=FLAGS.vllm_kvcache_gib,
                              max_num_batched_tokens=FLAGS.vllm_max_num_batched_tokens)
        backend.requests = requests
        return backend
    return TransformersBackend(hf_dir, FLAGS.dtype, FLAGS.torch_device, FLAGS.torch_threads or os.cpu_count(),
                               FLAGS.static_batch, FLAGS.static_sort)


# ------------------------------------------------------------------ the benchmark

def rotated(items: list, rep: int) -> list:
    """`items` in the order of repeat `rep`: each repeat starts one later, so each takes every place."""
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


def time_backends(backends, requests) -> dict:
    """Warm each backend up, then time them round-robin over the repeats."""
    results = {}
    for b in backends:
        compiles = CompileCounter.count
        results[b.name] = {"load_s": getattr(b, "load_s", None), "warmup_s": b.warmup(),
                           "warmup_compiles": CompileCounter.count - compiles, "repeats": []}
    # As engine.entrypoints.serve does, and vLLM's engine core (in its own process here) does for itself: the start-up
    # heap out of the cyclic GC's sight, else a full collection of it lands in a timed run.
    freeze_startup_heap()
    for rep in range(FLAGS.repeats):
        for b in rotated(backends, rep):
            time.sleep(FLAGS.settle_s)
            results[b.name]["repeats"].append(run_metrics(b.run(requests), requests))
    for name, r in results.items():
        numeric = [k for k, v in r["repeats"][0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        r["median"] = {k: bc.median(rep[k] for rep in r["repeats"]) for k in numeric}
        r["all_outputs_complete"] = all(rep["all_outputs_complete"] for rep in r["repeats"])
        if "compiles" in r["repeats"][0]:  # any compile in a timed run is a shape that escaped warm-up
            r["compiles_after_warmup"] = sum(rep["compiles"] for rep in r["repeats"])
    return results


def time_single_request(backends, vocab_size: int) -> dict:
    """Ferry, transformers and vLLM, one request each, interleaved over the repeats; medians."""
    prompt = single_request_prompt(vocab_size)
    chosen = [b for b in backends if b.name in SINGLE_BACKENDS or b.name.startswith("ferry@")]
    raw = {b.name: [] for b in chosen}
    for rep in range(FLAGS.repeats):
        for b in rotated(chosen, rep):
            time.sleep(FLAGS.settle_s)
            raw[b.name].append(b.single(prompt, FLAGS.single_output_len))
    out = {"prompt_len": FLAGS.single_prompt_len, "output_len": FLAGS.single_output_len, "backends": {}}
    for name, reps in raw.items():
        keys = [k for k, v in reps[0].items() if v is not None]
        out["backends"][name] = {"repeats": reps, "median": {k: bc.median(r[k] for r in reps) for k in keys}}
    for peer in ("transformers", "vllm"):
        if "ferry" in raw and peer in raw:
            ms = {n: out["backends"][n]["median"]["ms_per_token"] for n in ("ferry", peer)}
            out[f"{peer}_over_ferry_ms_per_token"] = bc.ratio(ms[peer], ms["ferry"])
    return out


def throughput_ratios(results: dict, names: list[str]) -> dict:
    """For each pair a / b (a before b in --compare): the ratio of median output tokens/s, and the
    median of the per-repeat ratios (each pair of runs side by side in one round)."""
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = results[a], results[b]
            paired = [x["output_tokens_per_s"] / y["output_tokens_per_s"]
                      for x, y in zip(ra["repeats"], rb["repeats"])]
            out[f"{a}/{b}"] = {"of_medians": bc.ratio(ra["median"]["output_tokens_per_s"],
                                                      rb["median"]["output_tokens_per_s"]),
                               "median_of_paired": bc.median(paired), "paired": paired}
    return out


def percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def print_report(summary: dict, results: dict, ratios: dict, single: dict | None):
    w = summary
    print(f"\nworkload: {w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output "
          f"tokens; medians of {FLAGS.repeats} interleaved repeats")
    # compiles: all timed runs together (0 = every shape was warmed up); host %: scheduler + packing +
    # postprocessing, of step time (the rest is the jitted call); ahead %: steps planned before the last one's
    # tokens were back (async scheduling), of all steps; preempt: median per run.
    # TTFT: from each request's submission (offline: mostly queueing); hit %: prefix-cache hits / queries.
    headers = ["backend", "req/s", "out tok/s", "total tok/s", "time s", "TTFT p50 ms", "TTFT p99 ms", "hit %",
               "warm-up s", "compiles", "host %", "ahead %", "preempt", "peak KV %"]
    rows = []
    for name, r in results.items():
        m = r["median"]
        rows.append([name, m["requests_per_s"], m["output_tokens_per_s"], m["total_tokens_per_s"], m["elapsed_s"],
                     m.get("ttft_ms_p50"), m.get("ttft_ms_p99"), percent(m.get("prefix_cache_hit_rate")),
                     r["warmup_s"], r.get("compiles_after_warmup"), percent(m.get("host_share")),
                     percent(m["planned_ahead"] / m["steps"]) if m.get("steps") else None, m.get("preemptions"),
                     percent(m.get("peak_kv_usage"))])
    print(bc.format_table(headers, rows))
    if ratios:
        print("\nratios of output tokens/s (of medians; median of per-repeat pairs):")
        for pair, r in ratios.items():
            print(f"  {pair}: {r['of_medians']:.2f}x; {r['median_of_paired']:.2f}x")
    if single:
        print(f"\nsingle request (prompt {single['prompt_len']}, output {single['output_len']}), medians:")
        rows = [[name, s["median"]["ttft_ms"], s["median"]["ms_per_token"], s["median"].get("decode_ms_per_token"),
                 s["median"]["e2e_ms"]] for name, s in single["backends"].items()]
        print(bc.format_table(["backend", "first token ms", "ms/token", "decode ms/token", "e2e ms"], rows))
        for peer in ("transformers", "vllm"):
            if single.get(f"{peer}_over_ferry_ms_per_token"):
                print(f"  {peer} / ferry ms per token: {single[f'{peer}_over_ferry_ms_per_token']:.2f}x")


def main(argv):
    del argv
    names = FLAGS.compare or [FLAGS.backend]
    unknown = {n for n in names if n not in BACKENDS and not is_variant(n)}
    if unknown or len(set(names)) != len(names):
        raise app.UsageError(f"--compare takes distinct names from {BACKENDS} or ferry@field=value, got {names}")
    for name in filter(is_variant, names):
        config_variant(name, EngineConfig())  # a bad field fails now, not after the model is built
    names, skipped = available_backends(names)
    if FLAGS.workload == "multi_turn" and set(names) - {"ferry", "ferry-nocache"}:
        raise app.UsageError("--workload=multi_turn runs only the ferry and ferry-nocache backends")
    if "ferry-static" in names and FLAGS.static_batch > FLAGS.max_num_seqs:
        logging.warning("--static_batch=%d > --max_num_seqs=%d: ferry-static runs each batch in waves",
                        FLAGS.static_batch, FLAGS.max_num_seqs)
    CompileCounter.install()
    with tempfile.TemporaryDirectory(prefix="ferry_bench_") as scratch:
        t0 = time.perf_counter()
        model, hf_dir, source = prepare_model(names, scratch)
        load_s = time.perf_counter() - t0  # Ferry's; transformers' is its backend's load_s
        requests = build_workload(model)
        config = engine_config(requests)
        backends = []
        try:
            for n in names:
                backends.append(make_backend(n, model, hf_dir, config, requests, scratch))
            results = time_backends(backends, requests)
            single = time_single_request(backends, model.cfg.vocab_size) if FLAGS.single_request else None
        finally:
            for b in backends:
                if hasattr(b, "close"):  # the vLLM worker process
                    b.close()
    ratios = throughput_ratios(results, names)
    summary = bc.workload_summary(requests)
    print_report(summary, results, ratios, single)
    if FLAGS.json_out:
        import jax
        bc.write_json(FLAGS.json_out, {
            "benchmark": "throughput", "config": bc.flag_values(FLAGS), "backends_run": names,
            "backends_skipped": skipped,
            "environment": {**bc.environment(), "jax_backend": jax.default_backend(),
                            "jax_devices": [str(d) for d in jax.devices()]},
            "model": {"source": source, "config": model.cfg.to_json(), "dtype": str(model.dtype), "load_s": load_s,
                      "num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(model.params())))},
            "engine_config": dataclasses.asdict(config), "workload": summary, "results": results,
            "ratios": ratios, "single_request": single})
        print(f"\nwrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
