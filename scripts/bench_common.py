"""Helpers shared by the benchmark scripts: workloads, summary statistics, tables, JSON.

Imported by scripts/benchmark_throughput.py, benchmark_serving.py and plot_benchmarks.py, which
find it beside themselves (a script's own directory is first on sys.path).
"""

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys

import numpy as np

PERCENTILES = (50, 90, 99)


# ------------------------------------------------------------------ workloads

@dataclasses.dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int] | None     # token ids (random workloads, or a tokenized dataset prompt)
    prompt_text: str | None          # the text, where there is one
    output_len: int                  # tokens to generate (EOS ignored)
    # A later turn of a chat: the index of the request whose prompt + output this prompt continues (it is
    # sent once that one finished); prompt_ids then holds only the new message.
    follows: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids is not None else 0


def parse_int_range(text: str) -> tuple[int, int]:
    """"32,512" -> (32, 512); "64" -> (64, 64). Both ends inclusive."""
    parts = [int(p) for p in str(text).split(",") if p.strip()]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise ValueError(f"expected 'lo,hi' with 1 <= lo <= hi, got {text!r}")
    return parts[0], parts[1]


def random_lengths(rng: np.random.Generator, num: int, bounds: tuple[int, int]) -> list[int]:
    return rng.integers(bounds[0], bounds[1] + 1, size=num).tolist()


def random_token_requests(num: int, prompt_len_range: tuple[int, int], output_len_range: tuple[int, int],
                          vocab_size: int, seed: int) -> list[BenchRequest]:
    """Prompts of uniform random length with token ids uniform over the vocabulary (as vLLM's random
    dataset): seeded, so every backend and every repeat sees the same workload."""
    rng = np.random.default_rng(seed)
    prompt_lens = random_lengths(rng, num, prompt_len_range)
    output_lens = random_lengths(rng, num, output_len_range)
    return [BenchRequest(rng.integers(0, vocab_size, size=p).tolist(), None, o)
            for p, o in zip(prompt_lens, output_lens)]


def shared_prefix_requests(num: int, shared_len: int, suffix_len_range: tuple[int, int],
                           output_len_range: tuple[int, int], vocab_size: int, seed: int) -> list[BenchRequest]:
    """Every prompt = one common `shared_len`-token "system prompt" + its own random suffix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab_size, size=shared_len).tolist()
    return [BenchRequest(shared + r.prompt_ids, None, r.output_len)
            for r in random_token_requests(num, suffix_len_range, output_len_range, vocab_size, seed + 1)]


def multi_turn_requests(num_chats: int, turns: int, shared_len: int, message_len_range: tuple[int, int],
                        output_len_range: tuple[int, int], vocab_size: int, seed: int) -> list[BenchRequest]:
    """`num_chats` chats of `turns` turns over one shared system prompt: turn 0 is system prompt + a user
    message; each later turn resends the whole history (previous prompt + its answer) + a new message.
    Ordered turn by turn (all chats' first turns, then the second turns, ...)."""
    first = shared_prefix_requests(num_chats, shared_len, message_len_range, output_len_range, vocab_size, seed)
    later = random_token_requests(num_chats * (turns - 1), message_len_range, output_len_range, vocab_size, seed + 2)
    requests = list(first)
    for r in later:
        r.follows = len(requests) - num_chats  # the same chat's previous turn
        requests.append(r)
    return requests


def full_prompt_lens(requests: list[BenchRequest]) -> list[int]:
    """Each request's prompt length as sent: a later chat turn carries its history (outputs at full length)."""
    lens = []
    for r in requests:
        history = 0 if r.follows is None else lens[r.follows] + requests[r.follows].output_len
        lens.append(history + r.prompt_len)
    return lens


def read_jsonl_prompts(path: str, num: int) -> list[dict]:
    """The first `num` records of a JSONL file of {"prompt": str, "output_len": int (optional)}."""
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{line_no}: expected a string field 'prompt'")
            records.append(record)
            if len(records) == num:
                break
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def dataset_requests(records: list[dict], encode, output_len_range: tuple[int, int],
                     seed: int) -> list[BenchRequest]:
    """Tokenize dataset prompts; a record's own "output_len" wins over a random one from the range."""
    rng = np.random.default_rng(seed)
    fallback = random_lengths(rng, len(records), output_len_range)
    return [BenchRequest(list(encode(r["prompt"])), r["prompt"], int(r.get("output_len") or o))
            for r, o in zip(records, fallback)]


def workload_summary(requests: list[BenchRequest]) -> dict:
    prompt_lens = full_prompt_lens(requests)
    output_lens = [r.output_len for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(prompt_lens), "output_tokens": sum(output_lens),
            "prompt_len": min_mean_max(prompt_lens), "output_len": min_mean_max(output_lens)}


# ------------------------------------------------------------------ statistics

def min_mean_max(values) -> dict:
    values = list(values)
    if not values:
        return {"min": None, "mean": None, "max": None}
    return {"min": min(values), "mean": float(np.mean(values)), "max": max(values)}


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def summarize(values, percentiles=PERCENTILES) -> dict:
    """mean, std, min, max and the percentiles (linear interpolation, as numpy and vLLM) of `values`;
    every field None when there are none."""
    values = np.asarray([v for v in values if v is not None], dtype=np.float64)
    keys = ["n", "mean", "std", "min", "max"] + [f"p{p}" for p in percentiles]
    if values.size == 0:
        return {k: (0 if k == "n" else None) for k in keys}
    out = {"n": int(values.size), "mean": float(values.mean()), "std": float(values.std()),
           "min": float(values.min()), "max": float(values.max())}
    for p, v in zip(percentiles, np.percentile(values, percentiles)):
        out[f"p{p}"] = float(v)
    return out


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


# ------------------------------------------------------------------ output

def format_value(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: list[str], rows: list[list], digits: int = 2) -> str:
    """Plain-text table: first column left-aligned, the rest right-aligned."""
    cells = [[format_value(v, digits) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _jsonable(value):
    """Strict JSON: numpy scalars to Python, non-finite floats to strings ("inf")."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_jsonable(obj), f, indent=2, allow_nan=False)
        f.write("\n")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def flag_values(flags_obj) -> dict:
    """The values of the flags the running script defined (not absl's own)."""
    return {f.name: f.value for f in flags_obj.get_flags_for_module(sys.argv[0])}


def environment() -> dict:
    """Where a result came from: host, Python, the git commit of the checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "git_commit": commit, "argv": sys.argv}
