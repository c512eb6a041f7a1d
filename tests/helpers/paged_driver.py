"""The paged greedy driver: the model through Ferry's paged step, no PyTorch needed.

Batched prefill of several prompts, then decode one token a step, all through the paged cache with
shuffled block tables. Used against transformers (tests/helpers/hf_models.py re-exports it for those tests)
and against the reference attention path (tests/models/test_paged_forward.py, which also runs in the
torch-free jax-0.11 CI environment).
"""

import dataclasses

import jax
import numpy as np

from engine.worker.packing import SeqSlice, StepLayout, bucket, pack
from engine.worker.step import model_step
from models.paged import cache_page_dims, init_kv_cache, kv_cache_groups
from pallas_kernels.kernels import Kernels


@dataclasses.dataclass
class PagedRun:
    prompt_logits: list[np.ndarray]  # per prompt [len(prompt), vocab]
    tokens: list[list[int]]          # greedy continuation per prompt
    step_logits: list[np.ndarray]    # per prompt [num_new, vocab]: the logits each token was taken from


def paged_greedy(loaded, prompts, num_new, *, block_size=8, split=None, attention_impl=None, kv_dtype=None):
    """Prefill all prompts in one batched call (or two: the first `split` tokens, then the rest),
    then decode them together one token per step, all through the paged cache (a block id of every KV cache
    group per page)."""
    cfg = loaded.cfg
    kernels = Kernels.for_platform(jax.default_backend(), loaded.dtype, kv_dtype or loaded.dtype, attention_impl)
    max_len = max(len(p) for p in prompts) + num_new
    groups = kv_cache_groups(cfg)
    per_seq = -(-max_len // block_size)
    ids_per_seq = per_seq * groups.num_groups
    cache = init_kv_cache(groups.num_slots, 1 + ids_per_seq * len(prompts), block_size,
                          *cache_page_dims(cfg, kernels, kv_dtype or loaded.dtype), kv_dtype or loaded.dtype,
                          cfg.kv_cache_layout[0])
    tables = [list(range(1 + i * ids_per_seq, 1 + (i + 1) * ids_per_seq)) for i in range(len(prompts))]
    rng = np.random.default_rng(0)
    for t in tables:  # pages need not be contiguous or ordered
        rng.shuffle(t)
    num_seqs = bucket(len(prompts))
    bounds = [(0, split), (split, None)] if split else [(0, None)]
    prompt_logits = [[] for _ in prompts]
    for lo, hi in bounds:
        seqs = [SeqSlice(p[lo:hi], lo, t) for p, t in zip(prompts, tables)]
        rows = sum(len(s.token_ids) for s in seqs)
        layout = StepLayout(bucket(rows, 16), num_seqs, per_seq, bucket(rows, 16), decode=False,
                            kv_groups=groups.num_groups)
        logits, cache = model_step(loaded.graphdef, loaded.state, cache,
                                   pack(seqs, layout, block_size, all_logits=True), layout, kernels)
        logits, row = np.asarray(logits), 0
        for i, s in enumerate(seqs):
            prompt_logits[i].append(logits[row:row + len(s.token_ids)])
            row += len(s.token_ids)
    prompt_logits = [np.concatenate(chunks) for chunks in prompt_logits]
    tokens = [[int(logits[-1].argmax())] for logits in prompt_logits]
    step_logits = [[logits[-1]] for logits in prompt_logits]
    layout = StepLayout(num_seqs, num_seqs, per_seq, num_seqs, decode=True, kv_groups=groups.num_groups)
    for _ in range(num_new - 1):
        seqs = [SeqSlice([tok[-1]], len(p) + len(tok) - 1, t) for p, tok, t in zip(prompts, tokens, tables)]
        logits, cache = model_step(loaded.graphdef, loaded.state, cache, pack(seqs, layout, block_size),
                                   layout, kernels)
        logits = np.asarray(logits)
        for i in range(len(prompts)):
            tokens[i].append(int(logits[i].argmax()))
            step_logits[i].append(logits[i])
    return PagedRun(prompt_logits, tokens, [np.stack(s) for s in step_logits])


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))
