"""EngineConfig: every setting of one engine (cache, batch, parallelism, scheduling, warm-up)."""

import dataclasses

from engine.core.scheduler import PREEMPTION_MODES
from models.quantization import GROUP_SIZES, QUANTIZATIONS
from pallas_kernels.kv_quant import resolve_kv_dtype

WARMUP_MODES = ("full", "lazy", "none")
TASKS = ("generate", "embed")


@dataclasses.dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None          # KV blocks incl. the null block; None: from the budget below
    memory_fraction: float = 0.5           # of free accelerator memory for the KV cache (not on CPU)
    cpu_kv_cache_gib: float = 4.0          # KV-cache budget on CPU, GiB (as vLLM's VLLM_CPU_KVCACHE_SPACE)
    max_num_seqs: int = 64                 # decode batch cap
    max_num_batched_tokens: int = 512      # tokens per step (decode + prefill chunks)
    max_model_len: int | None = None       # None: the model's own
    chunk_size: int | None = None          # prefill chunk cap; None: whole prompts up to the token budget
    watermark_blocks: int = 0
    preemption_mode: str = "swap"          # or "recompute"
    num_host_blocks: int | None = None     # swap space; None: as many as device blocks
    kv_dtype: str | None = None            # None: the model's dtype; a float dtype, or "int8" / "fp8"
                                           # (float8_e4m3fn): quantized, a float32 scale per token and KV head
                                           # (pallas_kernels/kv_quant.py)
    quantization: str | None = None        # quantize a float checkpoint's linears on load: int8, int4 or fp8
                                           # (weight-only; models/quantization.py)
    quantization_group_size: int = 128     # int4's rows of K per scale
    attention_impl: str | None = None      # None: by the devices' platform (pallas_kernels/kernels.py)
    dtype: str | None = None               # model dtype when loading from a path
    seed: int = 0                          # draws the seeds of requests that give none
    enable_prefix_caching: bool = True     # reuse the K/V of cached leading prompt blocks (kv_cache_manager)
    tensor_parallel_size: int = 1          # devices one model is split over (models/sharding.py)
    data_parallel_size: int = 1            # independent replicas, each on its own tensor_parallel_size devices
    expert_parallel: bool = False          # MoE models on tensor_parallel_size devices: each device holds whole
                                           # experts (False: a share of every expert's units; models/moe.py)
    scan_layers: bool = True               # one scanned layer (compile time independent of depth); False:
                                           # layers unrolled, compile time ~ depth
    async_scheduling: bool = True          # plan and dispatch the next decode step while the last one runs,
                                           # its tokens fed on the device (LLMEngine.step_core)
    warmup: str = "none"                   # compile in __init__: "full" every step shape, both samplers;
                                           # "lazy" each sampler's largest decode and prefill (steps pad up
                                           # to them), the rest in the background;
                                           # "none" each shape on first use
    task: str = "generate"                 # "embed": embedding requests only (PoolingParams), and warm-up
                                           # compiles the pooling programs instead of the samplers'; with
                                           # "generate" embedding requests work too, compiling on first use

    def __post_init__(self):
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be {' or '.join(map(repr, PREEMPTION_MODES))}, not "
                             f"{self.preemption_mode!r}")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, not {self.warmup!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.quantization_group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, not "
                             f"{self.quantization_group_size!r}")
        if self.kv_dtype is not None:
            resolve_kv_dtype(self.kv_dtype)  # ValueError naming the choices
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, not {self.cpu_kv_cache_gib}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
