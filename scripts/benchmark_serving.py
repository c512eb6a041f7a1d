"""Online serving benchmark against a running OpenAI-compatible server (as vLLM's `bench serve`).

Requests are streaming completions (`stream_options.include_usage`, so token counts are the
server's own), sent with Poisson arrivals at --request_rate (inf: all at once) and/or at most
--max_concurrency in flight. Per request it measures:

  TTFT  time to the first streamed chunk
  TPOT  (e2e - TTFT) / (output tokens - 1): the mean time per token after the first
  ITL   every gap between consecutive chunks (a chunk carrying several tokens is one gap)
  E2E   request sent to the stream's end

and reports mean, p50, p90, p99 of each, request and token throughput, and goodput: requests per
second that met every SLO given (--slo_ttft_ms, --slo_tpot_ms, --slo_e2e_ms). --concurrency_sweep
runs the same requests at several concurrency levels and prints one table.

Prompts: random words (a length in words, about as many tokens), random token ids decoded with
--tokenizer=DIR (vLLM's random dataset), raw token ids (--token_id_prompts, ids < --vocab), or
--dataset=prompts.jsonl ({"prompt": str, "output_len": int (optional)}). EOS is ignored (the vLLM
extension field `ignore_eos`; --noignore_eos for servers that reject it) so outputs run their length.

    python scripts/benchmark_serving.py --base_url=http://127.0.0.1:8000 --num_prompts=200 \
        --concurrency_sweep=1,4,16,64 --slo_ttft_ms=500 --slo_tpot_ms=50 --json_out=serving.json
"""

import asyncio
import dataclasses
import json
import math
import os
import time

import bench_common as bc
import httpx
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
# server
flags.DEFINE_string("base_url", "http://127.0.0.1:8000", "server root (the endpoint path is appended)")
flags.DEFINE_string("endpoint", "/v1/completions", "/v1/completions or /v1/chat/completions")
flags.DEFINE_string("model", None, "model name to request; default: the first of GET /v1/models")
flags.DEFINE_string("api_key", None, "bearer token (default: $OPENAI_API_KEY, if set)")
flags.DEFINE_float("timeout_s", 600.0, "per-request timeout")
# workload
flags.DEFINE_integer("num_prompts", 100, "requests per run")
flags.DEFINE_string("prompt_len_range", "32,512", "random prompt lengths: lo,hi (inclusive)")
flags.DEFINE_string("output_len_range", "32,256", "output lengths (max_tokens): lo,hi (inclusive)")
flags.DEFINE_string("dataset", None, 'JSONL of {"prompt": str, "output_len": int (optional)}')
flags.DEFINE_string("tokenizer", None, "model directory whose tokenizer turns random token ids into text")
flags.DEFINE_bool("token_id_prompts", False, "send prompts as token id lists (completions endpoint only)")
flags.DEFINE_integer("vocab", 32000, "token id range for --token_id_prompts")
flags.DEFINE_bool("ignore_eos", True, "send ignore_eos (vLLM extension) so outputs run to max_tokens")
flags.DEFINE_float("temperature", 0.0, "sampling temperature")
flags.DEFINE_integer("seed", 0, "workload and arrival-time seed")
# load
flags.DEFINE_float("request_rate", math.inf, "Poisson arrival rate, requests/s (inf: all at once)")
flags.DEFINE_integer("max_concurrency", None, "most requests in flight (default: unbounded)")
flags.DEFINE_list("concurrency_sweep", None, "run at each of these max_concurrency levels, e.g. 1,4,16")
flags.DEFINE_integer("warmup_requests", 1, "untimed requests sent first (also a connectivity check)")
# goodput
flags.DEFINE_float("slo_ttft_ms", None, "goodput SLO on time to first token")
flags.DEFINE_float("slo_tpot_ms", None, "goodput SLO on time per output token")
flags.DEFINE_float("slo_e2e_ms", None, "goodput SLO on end-to-end latency")
flags.DEFINE_string("json_out", None, "write every result here")

# Common short words: about one token each in most tokenizers, so a prompt of n words is ~n tokens.
WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from "
         "or had by word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way about many then them write would like so these her long make "
         "thing see him two has look more day could go come did number sound no most people my over know "
         "water than call first who may down side been now find any new work part take get place made live "
         "where after back little only round man year came show every good me give our under name very").split()


@dataclasses.dataclass(slots=True)
class RequestResult:
    ok: bool
    error: str | None = None
    start_s: float = 0.0                  # sent, seconds after the run began
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int | None = None      # from the server's usage
    output_tokens: int = 0                # usage.completion_tokens, else the number of chunks
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ------------------------------------------------------------------ workload

def random_word_prompt(rng: np.random.Generator, length: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=length))


def build_prompts() -> list[tuple[str | list[int], int]]:
    """(prompt: text or token ids, max_tokens) per request, seeded."""
    output_range = bc.parse_int_range(FLAGS.output_len_range)
    if FLAGS.dataset:
        records = bc.read_jsonl_prompts(FLAGS.dataset, FLAGS.num_prompts)
        lens = bc.random_lengths(np.random.default_rng(FLAGS.seed), len(records), output_range)
        return [(r["prompt"], int(r.get("output_len") or n)) for r, n in zip(records, lens)]
    if FLAGS.tokenizer or FLAGS.token_id_prompts:
        vocab = FLAGS.vocab
        decode = None
        if FLAGS.tokenizer:
            from models.tokenizers.load import load_tokenizer
            tokenizer = load_tokenizer(FLAGS.tokenizer)
            vocab, decode = tokenizer.vocab_size, tokenizer.decode
        requests = bc.random_token_requests(FLAGS.num_prompts, bc.parse_int_range(FLAGS.prompt_len_range),
                                            output_range, vocab, FLAGS.seed)
        return [(decode(r.prompt_ids) if decode else r.prompt_ids, r.output_len) for r in requests]
    rng = np.random.default_rng(FLAGS.seed)
    prompt_lens = bc.random_lengths(rng, FLAGS.num_prompts, bc.parse_int_range(FLAGS.prompt_len_range))
    output_lens = bc.random_lengths(rng, FLAGS.num_prompts, output_range)
    return [(random_word_prompt(rng, p), o) for p, o in zip(prompt_lens, output_lens)]


def is_chat() -> bool:
    return "chat" in FLAGS.endpoint


def request_body(model: str, prompt, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": FLAGS.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if FLAGS.ignore_eos:
        body["ignore_eos"] = True
    if is_chat():
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


# ------------------------------------------------------------------ one request

def headers() -> dict:
    key = FLAGS.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def send_request(client: httpx.AsyncClient, body: dict, run_start: float) -> RequestResult:
    """Stream one completion; every chunk that carries choices is a token arrival (as vLLM counts)."""
    sent = time.perf_counter()
    result = RequestResult(ok=False, start_s=sent - run_start)
    last = None
    try:
        async with client.stream("POST", FLAGS.base_url.rstrip("/") + FLAGS.endpoint, json=body,
                                 headers=headers()) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.output_tokens += 1
                if chunk.get("usage"):
                    result.usage_reported = True
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    result.output_tokens = chunk["usage"].get("completion_tokens", result.output_tokens)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - sent
    result.ok = result.ttft_s is not None
    if not result.ok:
        result.error = "the stream carried no tokens"
    return result


# ------------------------------------------------------------------ one run

async def arrivals(num: int, rate: float, rng: np.random.Generator):
    """Request indices, spaced by exponential gaps (a Poisson process) unless the rate is inf."""
    for i in range(num):
        yield i
        if math.isfinite(rate) and i + 1 < num:
            await asyncio.sleep(rng.exponential(1.0 / rate))


async def run_level(model: str, prompts, max_concurrency: int | None, rate: float) -> tuple[list, float]:
    """All requests at one load level: (results in request order, wall time of the run)."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(FLAGS.timeout_s), limits=limits) as client:
        for i in range(FLAGS.warmup_requests):
            prompt, _ = prompts[i % len(prompts)]
            warm = await send_request(client, request_body(model, prompt, 4), time.perf_counter())
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(body):
            if gate is None:
                return await send_request(client, body, start)
            async with gate:
                return await send_request(client, body, start)

        rng = np.random.default_rng(FLAGS.seed)
        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(prompts), rate, rng):
            prompt, max_tokens = prompts[i]
            tasks.append(asyncio.create_task(limited(request_body(model, prompt, max_tokens))))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def slos() -> dict:
    return {name: getattr(FLAGS, f"slo_{name}_ms") for name in ("ttft", "tpot", "e2e")
            if getattr(FLAGS, f"slo_{name}_ms") is not None}


def meets_slos(r: RequestResult, limits_ms: dict) -> bool:
    measured = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    # A one-token output has no TPOT: nothing to violate.
    return r.ok and all(measured[k] is None or 1e3 * measured[k] <= v for k, v in limits_ms.items())


def summary_ms(seconds) -> dict:
    return bc.summarize(1e3 * s for s in seconds if s is not None)


def level_metrics(results: list[RequestResult], duration: float, max_concurrency, rate) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    limits_ms = slos()
    return {
        "max_concurrency": max_concurrency, "request_rate": rate, "num_requests": len(results),
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "usage_reported": all(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summary_ms(r.ttft_s for r in ok), "tpot_ms": summary_ms(r.tpot_s for r in ok),
        "itl_ms": summary_ms(gap for r in ok for gap in r.itl_s), "e2e_ms": summary_ms(r.e2e_s for r in ok),
        "slo_ms": limits_ms,
        "goodput": sum(meets_slos(r, limits_ms) for r in ok) / duration if limits_ms else None,
        "errors": sorted({r.error for r in results if r.error})[:5],
        "per_request": [{"start_s": r.start_s, "ok": r.ok, "prompt_tokens": r.prompt_tokens,
                         "output_tokens": r.output_tokens, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                         "e2e_s": r.e2e_s, "num_chunks": len(r.itl_s) + (r.ttft_s is not None)} for r in results],
    }


# ------------------------------------------------------------------ report

def print_table(runs: list[dict]):
    headers = ["concurrency", "rate", "ok", "fail", "req/s", "out tok/s", "goodput"]
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        headers += [f"{metric} mean", f"{metric} p50", f"{metric} p99"]
    rows = []
    for r in runs:
        row = [r["max_concurrency"] or "inf", r["request_rate"], r["completed"], r["failed"], r["request_throughput"],
               r["output_throughput"], r["goodput"]]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            row += [r[key]["mean"], r[key]["p50"], r[key]["p99"]]
        rows.append(row)
    given = runs[0]["slo_ms"]
    print(f"latencies in ms; goodput: requests/s meeting every SLO (ms) {given}" if given else
          "latencies in ms; goodput: none (no --slo_* given)")
    print(bc.format_table(headers, rows))


def served_model() -> str:
    response = httpx.get(FLAGS.base_url.rstrip("/") + "/v1/models", headers=headers(), timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv):
    del argv
    if FLAGS.token_id_prompts and is_chat():
        raise app.UsageError("--token_id_prompts needs the completions endpoint")
    model = FLAGS.model or served_model()
    prompts = build_prompts()
    levels = [int(c) for c in FLAGS.concurrency_sweep] if FLAGS.concurrency_sweep else [FLAGS.max_concurrency]
    runs = []
    for level in levels:
        results, duration = asyncio.run(run_level(model, prompts, level, FLAGS.request_rate))
        runs.append(level_metrics(results, duration, level, FLAGS.request_rate))
    print_table(runs)
    for r in runs:
        if r["errors"]:
            print(f"concurrency {r['max_concurrency']}: errors {r['errors']}")
    if FLAGS.json_out:
        bc.write_json(FLAGS.json_out, {"benchmark": "serving", "config": bc.flag_values(FLAGS),
                                       "environment": bc.environment(), "model": model,
                                       "workload": {"num_requests": len(prompts),
                                                    "max_tokens": bc.min_mean_max(n for _, n in prompts)},
                                       "runs": runs})
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
