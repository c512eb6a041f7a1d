"""LLMEngine: the scheduler and the runner in one loop.

Each `step()` asks the scheduler for a plan (reap, budget, admit, preempt, decode), has the runner
execute it on the device, and feeds the sampled tokens back to the scheduler.
"""

import dataclasses
import itertools
import math
import time

from engine.request import Request
from engine.runner import ModelRunner, num_blocks_for_memory
from engine.scheduler import Scheduler, SchedulerConfig
from models.loading import LoadedModel, load_model


@dataclasses.dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None          # KV blocks incl. the null block; None: from memory_fraction
    memory_fraction: float = 0.5           # of free device memory (host RAM on CPU) for the KV cache
    max_num_seqs: int = 64                 # decode batch cap
    max_num_batched_tokens: int = 512      # tokens per step (decode + prefill chunks)
    max_model_len: int | None = None       # None: the model's own
    chunk_size: int | None = None          # prefill chunk cap; None: whole prompts up to the token budget
    watermark_blocks: int = 0
    preemption_mode: str = "swap"          # or "recompute"
    num_host_blocks: int | None = None     # swap space; None: as many as device blocks
    kv_dtype: str | None = None            # None: the model's dtype
    attention_impl: str | None = None      # None: by backend (pallas_kernels.attention)
    dtype: str | None = None               # model dtype when loading from a path

    def __post_init__(self):
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', not {self.preemption_mode!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class LLMEngine:
    def __init__(self, model: LoadedModel | str, config: EngineConfig | None = None):
        config = config or EngineConfig()
        if isinstance(model, str):
            model = load_model(model, config.dtype)
        self.model, self.config = model, config
        max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        kv_dtype = config.kv_dtype or model.dtype
        blocks_per_seq = math.ceil(max_model_len / config.block_size)
        num_blocks = config.num_blocks or num_blocks_for_memory(
            model.cfg, config.block_size, kv_dtype, config.memory_fraction,
            cap_blocks=1 + config.max_num_seqs * blocks_per_seq)
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_model_len=max_model_len, chunk_size=config.chunk_size,
            watermark_blocks=config.watermark_blocks, preemption_mode=config.preemption_mode,
            num_host_blocks=num_blocks if config.num_host_blocks is None else config.num_host_blocks))
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_model_len=max_model_len, kv_dtype=kv_dtype, attention_impl=config.attention_impl)
        self._ids = itertools.count()
        self.step_times = {"schedule_s": 0.0, "execute_s": 0.0, "postprocess_s": 0.0, "steps": 0}

    def warmup(self) -> float:
        return self.runner.warmup()

    def add_request(self, prompt_token_ids, max_tokens: int = 16, *, request_id: str | None = None,
                    priority: int = 0, ignore_eos: bool = False, stop_token_ids=(), min_tokens: int = 0) -> Request:
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=list(prompt_token_ids), max_tokens=max_tokens, priority=priority,
            eos_token_ids=tuple(self.model.cfg.eos_token_ids), stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos, min_tokens=min_tokens)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str):
        request = self.scheduler.abort(request_id)
        if request is not None:
            self.runner.drop_swapped(request.host_block_ids)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self):
        """One engine step; returns the plan (its trace, and which requests advanced)."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        sampled = self.runner.execute(plan)
        t2 = time.perf_counter()
        self.scheduler.postprocess(plan, sampled)
        t3 = time.perf_counter()
        times = self.step_times
        times["schedule_s"] += t1 - t0
        times["execute_s"] += t2 - t1
        times["postprocess_s"] += t3 - t2
        times["steps"] += 1
        return plan

    def run_to_completion(self, max_steps: int | None = None):
        steps = 0
        while self.has_unfinished():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
        return steps
