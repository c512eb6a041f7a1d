"""absl flags shared by Ferry's command lines (ferry-generate, scripts/eval_tasks.py, the server).

Each `define_*_flags()` registers one group of flags on the global `FLAGS`; calling it again is a no-op, so
every entry point (and a test importing several of them) can ask for the groups it needs. Defaults are read
off `EngineConfig()` and `SamplingParams()`, so a command line and the library never disagree.

Flags are named after the field they set: engine flags after `EngineConfig` fields, sampling flags after
`SamplingParams` fields (the names JSONL overrides and OpenAI requests use), except `EngineConfig.seed`,
which is `--engine_seed` because `--seed` is the per-request sampling seed.

Bad values end the program with exit code 2 (the Unix convention for usage errors): flag syntax and
bounds while parsing (`parse_flags_or_exit`, for `app.run(flags_parser=...)`), sampling values when
`sampling_params_from_flags` raises `SamplingParamsError` naming the field (`exit_usage_error`).
"""

import dataclasses
import json
import os
import sys

import jax.numpy as jnp
from absl import flags, logging

import models  # its package directory holds the embedded model's directory
from engine.config import TASKS, WARMUP_MODES, EngineConfig
from engine.core.scheduler import PREEMPTION_MODES
from engine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from engine.worker.multihost import DistributedConfig
from models.checkpoints.gguf import GGUF_SUFFIX
from models.hub import resolve_model_name
from models.packaged import PACKAGED_MODELS
from models.quantization import GROUP_SIZES, QUANTIZATIONS
from pallas_kernels.kernels import ATTENTION_IMPLS
from pallas_kernels.kv_quant import resolve_kv_dtype

FLAGS = flags.FLAGS

USAGE_ERROR = 2                      # exit status for bad flags and bad values
DEFAULT_MODEL = "models/default"     # the embedded model, relative to the working directory or the package
# Command lines cannot easily hold a newline, yet "\n" is the commonest stop string.
_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}

# EngineConfig field -> flag name, where they differ.
_ENGINE_FLAG_NAMES = {"seed": "engine_seed"}
_WARMUP_ALIASES = {"--warmup": "--warmup=full", "--nowarmup": "--warmup=none"}

_defined: set[str] = set()


def _once(group: str) -> bool:
    """True the first time `group` is asked for: absl refuses to define a flag twice."""
    if group in _defined:
        return False
    _defined.add(group)
    return True


# ------------------------------------------------------------------ definitions

def define_model_flags():
    if not _once("model"):
        return
    flags.DEFINE_string("model", DEFAULT_MODEL,
                        "model: a Hugging Face checkpoint directory (config.json + safetensors), a Ferry "
                        "checkpoint (ferry_config.json + model.safetensors), a .gguf file, or a packaged model's short "
                        f"name ({', '.join(PACKAGED_MODELS)})")


def define_progress_flag():
    if not _once("progress"):
        return
    flags.DEFINE_boolean("progress", True, "show a progress bar on stderr")


def define_engine_flags():
    """One flag per EngineConfig field."""
    if not _once("engine"):
        return
    d = EngineConfig()
    flags.DEFINE_integer("block_size", d.block_size, "tokens per KV-cache block", lower_bound=1)
    flags.DEFINE_integer("num_blocks", d.num_blocks, "KV blocks incl. the null block; unset: sized from "
                         "--memory_fraction (accelerators) or --cpu_kv_cache_gib (CPU)", lower_bound=2)
    flags.DEFINE_float("memory_fraction", d.memory_fraction, "share of free accelerator memory for the KV "
                       "cache when --num_blocks is unset", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("cpu_kv_cache_gib", d.cpu_kv_cache_gib, "KV-cache budget on CPU in GiB when --num_blocks "
                       "is unset (capped by what --max_num_seqs sequences of --max_model_len can use)",
                       lower_bound=1e-6)
    flags.DEFINE_integer("max_num_seqs", d.max_num_seqs, "most sequences decoded per step", lower_bound=1)
    flags.DEFINE_integer("max_num_batched_tokens", d.max_num_batched_tokens,
                         "most tokens per step (decodes + prefill chunks)", lower_bound=1)
    flags.DEFINE_integer("max_model_len", d.max_model_len, "context length cap (prompt + output); unset: "
                         "the model's own", lower_bound=2)
    flags.DEFINE_integer("chunk_size", d.chunk_size, "prefill chunk cap; unset: whole prompts up to the "
                         "token budget", lower_bound=1)
    flags.DEFINE_integer("watermark_blocks", d.watermark_blocks, "free blocks kept back when admitting",
                         lower_bound=0)
    flags.DEFINE_enum("preemption_mode", d.preemption_mode, PREEMPTION_MODES,
                      "what a preempted sequence's KV does: swap to host memory or recompute later")
    flags.DEFINE_integer("num_host_blocks", d.num_host_blocks, "host blocks for swapping; unset: as many as "
                         "device blocks", lower_bound=0)
    flags.DEFINE_string("kv_dtype", d.kv_dtype, "KV-cache dtype: float32, bfloat16, float16, or int8 / fp8 "
                        "(quantized, a float32 scale per token and KV head); unset: the model's")
    flags.DEFINE_enum("quantization", d.quantization, QUANTIZATIONS,
                      "quantize a float checkpoint's linears on load, weight-only (int8: per channel; int4: "
                      "groups of --quantization_group_size with offsets; fp8: e4m3 per channel); unset: as "
                      "stored (a GGUF's blocks stay quantized)")
    flags.DEFINE_enum("quantization_group_size", str(d.quantization_group_size), list(map(str, GROUP_SIZES)),
                      "int4's rows of K per scale")
    flags.DEFINE_enum("attention_impl", d.attention_impl, ATTENTION_IMPLS,
                      "paged attention implementation; unset: chosen by backend")
    flags.DEFINE_string("dtype", d.dtype, "dtype to load the weights in (e.g. bfloat16, float32); unset: "
                        "the checkpoint's")
    flags.DEFINE_boolean("enable_prefix_caching", d.enable_prefix_caching, "reuse the KV cache of prompt "
                         "blocks another request already computed (--noenable_prefix_caching: off)")
    flags.DEFINE_integer("engine_seed", d.seed, "draws the sampling seed of every request that sets none "
                         "(EngineConfig.seed)")
    flags.DEFINE_integer("tensor_parallel_size", d.tensor_parallel_size, "devices one model is split over "
                         "(heads, MLP units and vocabulary; the KV cache by KV heads)", lower_bound=1)
    flags.DEFINE_integer("data_parallel_size", d.data_parallel_size, "independent model replicas, each on its "
                         "own --tensor_parallel_size devices; requests go to the least loaded", lower_bound=1)
    flags.DEFINE_boolean("expert_parallel", d.expert_parallel, "a mixture-of-experts model's experts split "
                         "whole over the --tensor_parallel_size devices (expert parallel), not each expert's "
                         "units over them")
    flags.DEFINE_boolean("scan_layers", d.scan_layers, "run the decoder layers as one scanned layer (compile "
                         "time independent of depth); --noscan_layers unrolls them, for compile time growing "
                         "with depth (float32 CPU decode steps run as fast either way: a native matmul reads "
                         "the scanned layers' weights in place)")
    flags.DEFINE_boolean("async_scheduling", d.async_scheduling, "plan and dispatch each decode step before "
                         "the last one's tokens are back, feeding them on the device, so the accelerator does not "
                         "wait for the host between decode steps (steps with admissions, prefills, grammars, "
                         "penalties or min_tokens run synchronously); --noasync_scheduling runs every step "
                         "synchronously")
    flags.DEFINE_enum("warmup", d.warmup, WARMUP_MODES, "compile step shapes at start-up: full (all, before "
                      "serving), lazy (each sampler's largest decode and prefill first, which every step can pad "
                      "up to; the rest in the background), none (each on "
                      "first use); --nowarmup is --warmup=none")
    flags.DEFINE_enum("task", d.task, TASKS, "generate: text generation (embedding requests work too, their "
                      "programs compiling on first use); embed: embeddings only (/v1/embeddings), warm-up compiling "
                      "the pooling programs")


def define_distributed_flags():
    """Multi-host (engine/worker/multihost.py): one process per host, process 0 leads."""
    if not _once("distributed"):
        return
    d = DistributedConfig()
    flags.DEFINE_string("coordinator_address", d.coordinator_address, "host:port of process 0 for "
                        "jax.distributed; unset: one process (or the cluster's environment with --num_processes)")
    flags.DEFINE_integer("num_processes", d.num_processes, "processes (hosts) in the job", lower_bound=1)
    flags.DEFINE_integer("process_id", d.process_id, "this process's index; 0 serves, the others follow",
                         lower_bound=0)
    flags.DEFINE_integer("distributed_timeout_s", d.timeout_s, "seconds to wait for the other processes at "
                         "start-up, and before a dead one ends the job", lower_bound=1)


def distributed_config_from_flags() -> DistributedConfig:
    return DistributedConfig(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                             FLAGS.distributed_timeout_s)


def define_sampling_flags():
    """One flag per SamplingParams field; a request's own values (e.g. a JSONL line's) override them."""
    if not _once("sampling"):
        return
    d = SamplingParams()
    flags.DEFINE_integer("n", d.n, "completions per prompt")
    flags.DEFINE_integer("max_tokens", d.max_tokens, "most tokens to generate per completion")
    flags.DEFINE_integer("min_tokens", d.min_tokens, "tokens to generate before EOS / stop ids may end it")
    flags.DEFINE_float("temperature", d.temperature, "0 = greedy")
    flags.DEFINE_float("top_p", d.top_p, "nucleus sampling mass, in (0, 1]")
    flags.DEFINE_integer("top_k", d.top_k, "keep the k most likely tokens; 0 or -1 = off")
    flags.DEFINE_float("min_p", d.min_p, "drop tokens below min_p x the top probability, in [0, 1]")
    flags.DEFINE_integer("seed", d.seed, "sampling seed of every request (completion i of n uses seed + i); "
                         "unset: drawn from --engine_seed")
    flags.DEFINE_float("presence_penalty", d.presence_penalty, "in [-2, 2]")
    flags.DEFINE_float("frequency_penalty", d.frequency_penalty, "in [-2, 2]")
    flags.DEFINE_float("repetition_penalty", d.repetition_penalty, "> 0; 1 = off")
    flags.DEFINE_multi_string("stop", d.stop, "stop string (repeatable); \\n, \\t, \\r and \\\\ are unescaped")
    flags.DEFINE_multi_integer("stop_token_ids", d.stop_token_ids, "token id that ends a completion "
                               "(repeatable)")
    flags.DEFINE_boolean("ignore_eos", d.ignore_eos, "keep generating past EOS")
    flags.DEFINE_integer("logprobs", d.logprobs, f"top logprobs per generated token, 0..{MAX_LOGPROBS} "
                         "(0: the sampled token's only); unset: none")
    flags.DEFINE_integer("prompt_logprobs", d.prompt_logprobs, f"top logprobs per prompt token, "
                         f"0..{MAX_LOGPROBS}; unset: none")
    flags.DEFINE_integer("priority", d.priority, "scheduling priority (lower runs first)")
    flags.DEFINE_boolean("skip_special_tokens", d.skip_special_tokens, "leave special tokens out of the text")
    flags.DEFINE_boolean("include_stop_str_in_output", d.include_stop_str_in_output,
                         "keep the matched stop string in the text")
    flags.DEFINE_string("structured_outputs", None, 'constrained decoding, as JSON: {"json": SCHEMA}, '
                        '{"json_object": true}, {"regex": "..."}, {"choice": [...]} or {"grammar": "LARK"}')


# ------------------------------------------------------------------ builders

def engine_config_from_flags() -> EngineConfig:
    """An EngineConfig from the engine flags; ValueError names the flag of a bad value."""
    values = {f.name: getattr(FLAGS, _ENGINE_FLAG_NAMES.get(f.name, f.name))
              for f in dataclasses.fields(EngineConfig)}
    if values["dtype"] is not None:
        _check_dtype("dtype", values["dtype"])
    if values["kv_dtype"] is not None:
        try:
            resolve_kv_dtype(values["kv_dtype"])
        except ValueError as e:
            raise ValueError(f"--kv_dtype={values['kv_dtype']}: {e}") from None
    values["quantization_group_size"] = int(values["quantization_group_size"])
    return EngineConfig(**values)


def sampling_params_from_flags() -> SamplingParams:
    """SamplingParams from the sampling flags; SamplingParamsError (its .field is the flag) if invalid."""
    values = {f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(SamplingParams)}
    values["stop"] = [unescape(s) for s in values["stop"]]
    if values["structured_outputs"] is not None:
        try:
            values["structured_outputs"] = json.loads(values["structured_outputs"])
        except json.JSONDecodeError as e:
            raise SamplingParamsError("structured_outputs", f"--structured_outputs is not JSON: {e}") from None
    return SamplingParams(**values)


def unescape(text: str) -> str:
    """Turn the escapes in _ESCAPES into the characters; every other backslash stays as typed."""
    out, i = [], 0
    while i < len(text):
        pair = text[i:i + 2]
        if pair in _ESCAPES:
            out.append(_ESCAPES[pair])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _check_dtype(name: str, value: str):
    try:
        jnp.dtype(value)
    except TypeError:
        raise ValueError(f"--{name}={value}: not a dtype (try bfloat16, float16 or float32)") from None


# ------------------------------------------------------------------ the model directory

def resolve_model_dir(path: str) -> str:
    """The model `path` names: a directory, a .gguf file, a packaged model's short name (`smollm2`:
    models/packaged.py) or a Hugging Face repo id in the local cache (models/hub.py); FileNotFoundError (saying
    to pass --model, how to install the package, or where the cache is) if none.

    The default also resolves next to the installed `models` package, so `ferry-generate` finds the
    embedded model from any working directory."""
    path = path if path == DEFAULT_MODEL else resolve_model_name(path)
    candidates = [path]
    if path == DEFAULT_MODEL:
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(models.__file__)), "default"))
    for candidate in candidates:
        if _is_model(candidate):
            return candidate
    where = (f"pass --model=DIR, a Hugging Face or Ferry checkpoint directory, a .gguf file, a Hugging Face repo "
             f"id in the local cache, or {' or '.join(PACKAGED_MODELS)}")
    if path == DEFAULT_MODEL:
        raise FileNotFoundError(f"no model in the default --model={DEFAULT_MODEL} (the embedded model is not "
                                f"there yet): {where}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model={path}: no such file or directory; {where}")
    raise FileNotFoundError(f"--model={path}: not a model (no config.json, ferry_config.json or .gguf file); "
                            f"{where}")


def _is_model(path: str) -> bool:
    if os.path.isfile(path):
        return path.endswith(GGUF_SUFFIX)
    return os.path.isdir(path) and (
        any(os.path.isfile(os.path.join(path, name)) for name in ("config.json", "ferry_config.json"))
        or any(name.endswith(GGUF_SUFFIX) for name in os.listdir(path)))


# ------------------------------------------------------------------ errors

def parse_flags_or_exit(argv: list[str]) -> list[str]:
    """`app.run(main, flags_parser=parse_flags_or_exit)`: absl's own parser exits 1 on a bad flag; 2 here.
    --warmup and --nowarmup (once a boolean) still mean --warmup=full and --warmup=none."""
    argv = [_WARMUP_ALIASES.get(arg, arg) for arg in argv]
    try:
        return FLAGS(argv)
    except flags.Error as e:
        exit_usage_error(str(e))


def exit_usage_error(message: str):
    """Print `message` as a usage error and exit with status 2."""
    sys.stderr.write(f"error: {message}\nPass --helpfull to see every flag.\n")
    sys.exit(USAGE_ERROR)


def quiet_absl_logging():
    """WARNING unless --verbosity was given: JAX logs backend probing at INFO, noise on a command line."""
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def read_jsonl_objects(path: str, flag: str, error: type[Exception]) -> list[tuple[str, int, dict]]:
    """(where, line number, object) for each non-blank line of a JSONL file given as --`flag`; any
    unreadable file, bad line or empty file raises `error` with a message naming the file (and line)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise error(f"--{flag}={path}: {e.strerror}") from None
    objects = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: expected a JSON object")
        objects.append((where, number, obj))
    if not objects:
        raise error(f"--{flag}={path}: nothing in the file")
    return objects
