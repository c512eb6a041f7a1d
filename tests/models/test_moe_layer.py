"""The grouped expert computation (models/moe.py) against a per-token loop over the chosen experts, whole and
split over experts as expert parallelism splits it; the routing rules. No PyTorch needed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.moe import grouped_experts, route

E, K, H, I = 8, 2, 16, 8  # noqa: E741


def _cfg(**fields) -> ModelConfig:
    base = ModelConfig("mixtral", 32, H, 32, 1, 2, 1, 8, num_experts=E, num_experts_per_tok=K,
                       moe_intermediate_size=I, norm_topk_prob=True)
    return dataclasses.replace(base, **fields)


def _params(rng, bias: bool):
    p = {"gate_up_proj": rng.normal(size=(E, H, 2 * I)).astype(np.float32),
         "down_proj": rng.normal(size=(E, I, H)).astype(np.float32)}
    if bias:
        p |= {"gate_up_proj_bias": rng.normal(size=(E, 2 * I)).astype(np.float32),
              "down_proj_bias": rng.normal(size=(E, H)).astype(np.float32)}
    return p


def _loop(x, weights, ids, p, cfg):
    """Each token's chosen experts one at a time, in numpy (float64)."""
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            h = x[t] @ p["gate_up_proj"][e] + (p["gate_up_proj_bias"][e] if "gate_up_proj_bias" in p else 0)
            gate, up = h[:I], h[I:]
            if cfg.swiglu_limit is None:
                act = gate / (1 + np.exp(-gate)) * up
            else:
                gate, up = np.minimum(gate, cfg.swiglu_limit), np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
                act = (up + 1) * gate / (1 + np.exp(-cfg.swiglu_alpha * gate))
            y = act @ p["down_proj"][e] + (p["down_proj_bias"][e] if "down_proj_bias" in p else 0)
            out[t] += w * y
    return out


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_grouped_experts_match_a_loop_whole_and_split(gpt_oss):
    rng = np.random.default_rng(0)
    cfg = _cfg(swiglu_limit=1.5, expert_bias=True) if gpt_oss else _cfg()
    p = _params(rng, bias=gpt_oss)
    x = rng.normal(size=(11, H)).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(11, E)), jnp.float32), cfg)
    want = _loop(x, np.asarray(weights), np.asarray(ids), p, cfg)
    whole = grouped_experts(jnp.asarray(x), weights, ids, jax.tree.map(jnp.asarray, p), cfg)
    np.testing.assert_allclose(np.asarray(whole), want, rtol=2e-5, atol=2e-5)
    # Two shards of four experts each, as expert parallelism runs them: their sum is the whole
    halves = [grouped_experts(jnp.asarray(x), weights, ids, {k: jnp.asarray(v[s]) for k, v in p.items()}, cfg, first)
              for s, first in ((slice(0, 4), 0), (slice(4, 8), 4))]
    np.testing.assert_allclose(np.asarray(halves[0] + halves[1]), np.asarray(whole), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(halves[0])).sum() > 0 and np.abs(np.asarray(halves[1])).sum() > 0


def test_routing_rules():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 3.0]])
    probs = np.exp(np.asarray(logits[0])) / np.exp(np.asarray(logits[0])).sum()
    w, ids = route(logits, _cfg())  # softmax, top 2, renormalised
    assert ids.tolist() == [[7, 1]]
    np.testing.assert_allclose(np.asarray(w[0]), probs[[7, 1]] / probs[[7, 1]].sum(), rtol=1e-6)
    w, _ = route(logits, _cfg(norm_topk_prob=False))  # Qwen2-MoE: the probabilities as they are
    np.testing.assert_allclose(np.asarray(w[0]), probs[[7, 1]], rtol=1e-6)
    w, ids = route(logits, _cfg(router_topk_first=True))  # gpt-oss: the top logits, softmaxed among themselves
    np.testing.assert_allclose(np.asarray(w[0]), np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum(), rtol=1e-6)


def test_expert_layouts_must_divide_over_the_devices():
    from models.sharding import check_tensor_parallel  # noqa: PLC0415

    with pytest.raises(ValueError, match="expert_parallel over 3 devices must divide the model's 8 experts"):
        check_tensor_parallel(_cfg(expert_parallel=True), 3)
    with pytest.raises(ValueError, match="must divide the experts' 8 units"):
        check_tensor_parallel(_cfg(moe_intermediate_size=8, num_heads=4, num_kv_heads=4), 16)
    check_tensor_parallel(_cfg(num_heads=4, num_kv_heads=2, expert_parallel=True), 2)
