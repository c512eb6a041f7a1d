"""The backends Ferry's throughput is compared with (scripts/benchmark_throughput.py): transformers' `generate`
on static batches, and vLLM's offline engine in its own virtual environment (scripts/vllm_worker.py). Each
offers warmup(), run(requests) -> Run and single(prompt_ids, output_len) -> metrics."""

import dataclasses
import json
import os
import subprocess
import time

import bench_common as bc


@dataclasses.dataclass(slots=True)
class Run:
    """One timed pass of a backend over the whole workload."""

    elapsed_s: float
    produced: list[int]              # output tokens each request got (counted per request)
    extras: dict = dataclasses.field(default_factory=dict)


def static_batches(requests: list[bc.BenchRequest], size: int, sort: bool) -> list[list[int]]:
    """Request indices cut into consecutive batches of `size` (by prompt length if `sort`)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].prompt_len) if sort else list(range(len(requests)))
    return [order[i:i + size] for i in range(0, len(order), size)]


def single_metrics(first_s: float, total_s: float, tokens: int) -> dict:
    return {"ttft_ms": 1e3 * first_s, "e2e_ms": 1e3 * total_s, "output_tokens": tokens,
            "ms_per_token": 1e3 * total_s / tokens,
            "decode_ms_per_token": 1e3 * (total_s - first_s) / (tokens - 1) if tokens > 1 else None}


# ------------------------------------------------------------------ transformers

class TransformersBackend:
    name = "transformers"

    def __init__(self, model_dir: str, torch_dtype: str, device: str, threads: int, static_batch: int,
                 static_sort: bool):
        import torch
        import transformers

        self.torch = torch
        torch.set_num_threads(threads)
        self.threads, self.device = threads, device
        self.static_batch, self.static_sort = static_batch, static_sort
        # A GGUF file goes through transformers' own GGUF reader (dequantized, as Ferry loads it).
        where, gguf_file = (os.path.split(model_dir) if model_dir.endswith(".gguf") else (model_dir, None))
        t0 = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            where, gguf_file=gguf_file, dtype=getattr(torch, torch_dtype)).to(device).eval()
        self.load_s = time.perf_counter() - t0
        self.pad_id = self.model.config.pad_token_id or 0  # masked out: its value does not matter
        # A fresh generation config: greedy, no EOS at all (so every row runs max_new_tokens), none of
        # the checkpoint's sampling defaults.
        self.model.generation_config = transformers.GenerationConfig(
            do_sample=False, eos_token_id=None, pad_token_id=self.pad_id)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, streamer=None) -> int:
        """Greedy-generate a left-padded batch; returns how many tokens each row got."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, min_new_tokens=0, streamer=streamer)
        generated = out.shape[1] - width
        if generated != max_new_tokens:
            raise RuntimeError(f"transformers generated {generated} tokens, not {max_new_tokens}: EOS not disabled?")
        return generated

    def warmup(self) -> float:
        t0 = time.perf_counter()
        self._generate([[1, 2, 3], [4, 5]], 2)
        return time.perf_counter() - t0

    def run(self, requests: list[bc.BenchRequest]) -> Run:
        produced = [0] * len(requests)
        t0 = time.perf_counter()
        for batch in static_batches(requests, self.static_batch, self.static_sort):
            generated = self._generate([requests[i].prompt_ids for i in batch],
                                       max(requests[i].output_len for i in batch))
            for i in batch:  # the padding rows' extra tokens are not throughput
                produced[i] = min(requests[i].output_len, generated)
        return Run(time.perf_counter() - t0, produced, {"torch_threads": self.threads})

    def single(self, prompt_ids: list[int], output_len: int) -> dict:
        """One request alone, its first token timed by a streamer (as Ferry's by its first delta)."""
        clock = self._token_clock()
        t0 = time.perf_counter()
        produced = self._generate([prompt_ids], output_len, streamer=clock)
        total = time.perf_counter() - t0
        return single_metrics(clock.times[1] - t0, total, produced)

    @staticmethod
    def _token_clock():
        """A streamer that only timestamps: generate() puts the prompt, then each new token."""
        from transformers.generation.streamers import BaseStreamer

        class TokenClock(BaseStreamer):
            def __init__(self):
                self.times = []

            def put(self, value):
                self.times.append(time.perf_counter())

            def end(self):
                pass

        return TokenClock()


# ------------------------------------------------------------------ vLLM (a subprocess in its own venv)

class VllmBackend:
    """scripts/vllm_worker.py under --vllm_python: one vLLM engine for the whole benchmark, fed each
    timed pass as one JSON line; it times its own `generate` call (the pipe is not on the clock)."""

    name = "vllm"

    def __init__(self, python: str, model_dir: str, dtype: str, *, max_model_len: int, max_num_seqs: int, seed: int,
                 log_dir: str, threads_bind: str | None, kvcache_gib: float, max_num_batched_tokens: int | None):
        cpus = os.cpu_count() or 1
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's venv, not Ferry's tree
        env.update(VLLM_CPU_OMP_THREADS_BIND=threads_bind or f"0-{cpus - 1}",
                   VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib), TOKENIZERS_PARALLELISM="false")
        self.env = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
        self.args = {"model": model_dir, "dtype": dtype, "max_model_len": max_model_len,
                     "max_num_seqs": max_num_seqs, "seed": seed}
        if max_num_batched_tokens:
            self.args["max_num_batched_tokens"] = max_num_batched_tokens
        self.log_path = os.path.join(log_dir, "vllm_worker.log")
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
        self.proc = subprocess.Popen([python, worker, json.dumps(self.args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True, env=env)
        ready = self._answer()
        self.load_s, self.version = ready["load_s"], ready["vllm_version"]
        self.requests: list[bc.BenchRequest] = []  # the workload, for warm-up (set by make_backend)

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = open(self.log_path).read()[-4000:]
            raise RuntimeError(f"vLLM worker exited ({self.proc.returncode}):\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM worker: {answer['error']}")
        return answer

    def _ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _generate(self, requests: list[bc.BenchRequest]) -> dict:
        if any(r.follows is not None for r in requests):
            raise RuntimeError("the vllm backend runs independent requests only (not --workload=multi_turn)")
        return self._ask(op="generate", prompts=[r.prompt_ids for r in requests],
                         output_lens=[r.output_len for r in requests])

    def warmup(self) -> float:
        """One untimed pass over the workload: whatever vLLM compiles or captures on first sight of a
        shape happens here."""
        t0 = time.perf_counter()
        self._generate(self.requests)
        return time.perf_counter() - t0

    def run(self, requests: list[bc.BenchRequest]) -> Run:
        answer = self._generate(requests)
        return Run(answer["elapsed_s"], answer["produced"], {"vllm_version": self.version, **self.env})

    def single(self, prompt_ids: list[int], output_len: int) -> dict:
        answer = self._ask(op="single", prompt=prompt_ids, output_len=output_len)
        return single_metrics(answer["ttft_s"], answer["total_s"], answer["produced"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
