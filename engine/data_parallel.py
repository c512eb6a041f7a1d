"""Data parallelism: independent engine replicas on disjoint device groups, behind one engine interface.

Each replica is a whole `LLMEngine` (its own scheduler, KV cache and runner) on its own
tensor_parallel_size devices; requests go to the least loaded replica and stay there. `make_engine`
returns a plain `LLMEngine` for one replica, so the server, `LLM` and the command lines take either.
"""

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable, Sequence

import jax

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, model_tokenizer
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from models.loading import LoadedModel, load_model
from models.tokenizers.tokenizer import Tokenizer

# Scheduler.stats() entries that are fractions: combined weighted by each replica's pool, not summed.
_FRACTIONS = ("kv_usage", "host_usage")


def replica_device_groups(config: EngineConfig, devices=None) -> list[list]:
    """data_parallel_size disjoint groups of tensor_parallel_size devices, in device order."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp * dp:
        raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {tp * dp} devices; "
                         f"there are {len(devices)} {jax.default_backend()} devices")
    return [devices[i * tp:(i + 1) * tp] for i in range(dp)]


def make_engine(model: LoadedModel | str, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None):
    """An LLMEngine, or a DataParallelEngine of config.data_parallel_size of them."""
    config = config or EngineConfig()
    if config.data_parallel_size == 1:
        return LLMEngine(model, config, tokenizer)
    return DataParallelEngine(model, config, tokenizer)


class DataParallelEngine:
    """LLMEngine's interface over data_parallel_size replicas. Requests are routed to the replica with
    the fewest unfinished requests, then the most free KV blocks; each replica steps on its own thread
    (the jitted steps release the GIL, so the device groups work at the same time)."""

    def __init__(self, model: LoadedModel | str, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 devices=None):
        groups = replica_device_groups(config, devices)
        if isinstance(model, str):  # read once, on the host; each replica places its own copy
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                model = load_model(model, config.dtype)
        tokenizer = tokenizer or model_tokenizer(model)
        # Distinct seed streams: two replicas must not draw the same seeds for unseeded requests.
        self.replicas = [LLMEngine(model, _replica_config(config, i), tokenizer, devices=group)
                         for i, group in enumerate(groups)]
        first = self.replicas[0]
        self.config, self.tokenizer, self.model = config, tokenizer, first.model
        self.max_model_len = first.max_model_len
        self._replica_of: dict[str, LLMEngine] = {}
        self._ids = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas), thread_name_prefix="ferry-replica")

    # -------------------------------------------------------------- requests

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    final_only: bool = False) -> str:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._replica_of:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        replica = min(self.replicas, key=lambda r: (r.num_requests, -r.scheduler.block_pool.num_free))
        replica.add_request(request_id, prompt, params, cache_salt=cache_salt, final_only=final_only)
        self._replica_of[request_id] = replica
        return request_id

    def abort(self, request_id: str) -> bool:
        replica = self._replica_of.pop(request_id, None)
        return replica is not None and replica.abort(request_id)

    def full_output(self, request_id: str) -> Callable[[], RequestOutput]:
        return self._replica_of[request_id].full_output(request_id)

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    @property
    def num_requests(self) -> int:
        return sum(r.num_requests for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        """Every replica's cache; False if any of them holds a cached block in use (that one keeps its cache)."""
        return all([r.reset_prefix_cache() for r in self.replicas])

    # -------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        return self._finished(self._each_busy(LLMEngine.step))

    def step_core(self) -> list[tuple[LLMEngine, object]]:
        """Every busy replica's core step: [(replica, its StepNews), ...]."""
        busy = [r for r in self.replicas if r.has_unfinished()]
        return list(zip(busy, self._each(LLMEngine.step_core, busy)))

    def process_outputs(self, news: list[tuple[LLMEngine, object]]) -> list[RequestOutput]:
        return self._finished([out for replica, n in news for out in replica.process_outputs(n)])

    @staticmethod
    def step_trace(news: list[tuple[LLMEngine, object]]) -> list:
        return [entry for _, n in news for entry in n.trace]

    def _each_busy(self, fn) -> list[RequestOutput]:
        return [out for outs in self._each(fn, [r for r in self.replicas if r.has_unfinished()]) for out in outs]

    def _each(self, fn, replicas: list[LLMEngine]) -> list:
        """fn(replica) for each, on the replicas' threads when there are several (the jitted steps release the GIL)."""
        if len(replicas) == 1:
            return [fn(replicas[0])]
        return list(self._pool.map(fn, replicas))

    def _finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._replica_of.pop(out.request_id, None)
        return outputs

    def warmup(self, sampling: bool = True, background: bool = False) -> float:
        return sum(r.warmup(sampling, background) for r in self.replicas)

    # -------------------------------------------------------------- introspection

    def stats(self) -> dict:
        """Every replica's Scheduler.stats() combined (counts summed, usage over all blocks, the hit rate
        recomputed), with each replica's own under "replicas"."""
        per_replica = [r.stats() for r in self.replicas]
        total = {}
        for key, value in per_replica[0].items():
            values = [s[key] for s in per_replica]
            if isinstance(value, dict):
                total[key] = {k: sum(v.get(k, 0) for v in values) for k in {k for v in values for k in v}}
            elif key not in _FRACTIONS:
                total[key] = sum(values)
        blocks = [r.num_kv_blocks for r in self.replicas]
        for key in _FRACTIONS:
            total[key] = sum(s[key] * b for s, b in zip(per_replica, blocks)) / sum(blocks)
        total["step"] = max(s["step"] for s in per_replica)
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / max(total["prefix_cache_queries"], 1)
        return total | {"replicas": per_replica}

    @property
    def memory(self) -> dict:
        """Every replica's weights and KV cache (LLMEngine.memory) together; the KV bytes a token, one replica's."""
        first = self.replicas[0].memory
        return {key: first[key] if key == "kv_bytes_per_token" else sum(r.memory[key] for r in self.replicas)
                for key in first}

    def last_step_trace(self) -> list:
        return [entry for r in self.replicas for entry in r.last_step_trace()]

    @property
    def num_kv_blocks(self) -> int:
        return sum(r.num_kv_blocks for r in self.replicas)

    @property
    def timings(self) -> dict:
        """LLMEngine.timings summed over replicas (their steps overlap: seconds of work, not of wall time)."""
        return {key: sum(r.timings[key] for r in self.replicas) for key in self.replicas[0].timings}


def _replica_config(config: EngineConfig, index: int) -> EngineConfig:
    return dataclasses.replace(config, seed=config.seed + 7919 * index, data_parallel_size=1)
