"""SamplingParams validation and the batched on-device sampler against float64 numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.sampler import (
    MAX_LOGPROBS,
    TOP_CANDIDATES,
    SamplingMetadata,
    apply_penalties,
    build_sampling_metadata,
    filter_logits,
    greedy_argmax,
    sample,
    seed_bits,
    select_mode,
)

sample_jit = jax.jit(sample, static_argnames=("mode", "num_top_logprobs"))
penalties_jit = jax.jit(apply_penalties)

NUM_DRAWS = 4000
P_VALUE_FLOOR = 1e-3


# ---------------------------------------------------------------------------------------------
# SamplingParams

BAD_PARAMS = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[f"{f}={v}" for (kw, f) in BAD_PARAMS
                                                          for v in [kw[f]]])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_sampling_params_boundaries_and_normalisation():
    p = SamplingParams(top_k=-1, stop="###", top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                       frequency_penalty=2.0, logprobs=MAX_LOGPROBS, prompt_logprobs=0,
                       seed=2**63 - 1, max_tokens=None, min_tokens=5)
    assert p.top_k == 0 and p.stop == ["###"]
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams().max_tokens == 16 and SamplingParams().stop == []


# ---------------------------------------------------------------------------------------------
# helpers


def metadata(params: list[SamplingParams], *, seeds=None, output_index=None, histories=None,
             prompt_lens=None, batch=None, width=4, vocab_size=1 << 18) -> SamplingMetadata:
    # The default bitmask covers every vocabulary these tests use; the sampler ignores bits past V.
    n = len(params)
    seeds = [0] * n if seeds is None else seeds
    output_index = [0] * n if output_index is None else output_index
    histories = [[]] * n if histories is None else histories
    prompt_lens = [len(h) for h in histories] if prompt_lens is None else prompt_lens
    rows = list(zip(params, seeds, output_index, histories, prompt_lens))
    return build_sampling_metadata(rows, batch or n, width, vocab_size)


def draws(logits_row: np.ndarray, params: SamplingParams, seed: int = 1234) -> np.ndarray:
    """NUM_DRAWS tokens for one logits row: one batch row per output index, same seed."""
    md = metadata([params] * NUM_DRAWS, seeds=[seed] * NUM_DRAWS, output_index=list(range(NUM_DRAWS)))
    logits = np.broadcast_to(logits_row, (NUM_DRAWS, logits_row.size))
    return np.asarray(sample_jit(jnp.asarray(logits), md, mode="full", num_top_logprobs=0).tokens)


def reference_probs(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """vLLM's order in float64: temperature, top-k, top-p (smallest set with mass >= top_p), min-p."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.size, bool)
    keep[order[:top_k or z.size]] = True
    p = softmax64(np.where(keep, z, -np.inf))
    mass = np.cumsum(p[order])
    smallest = int(np.searchsorted(mass, top_p)) + 1
    keep[order[smallest:]] = False
    p = softmax64(np.where(keep, z, -np.inf))
    keep &= p >= min_p * p.max()
    return softmax64(np.where(keep, z, -np.inf))


def softmax64(z):
    e = np.exp(z - np.max(z))
    return e / e.sum()


def assert_matches_distribution(tokens: np.ndarray, probs: np.ndarray):
    support = probs > 0
    assert support[tokens].all(), f"drew tokens outside the kept set: {sorted(set(tokens[~support[tokens]]))}"
    observed = np.bincount(tokens, minlength=probs.size)[support]
    expected = probs[support] * tokens.size
    assert expected.min() >= 5, "test setup: chi-square needs >= 5 expected per bin"
    p_value = stats.chisquare(observed, expected).pvalue
    assert p_value > P_VALUE_FLOOR, (p_value, observed, expected.round(1))


def mid_between(values: np.ndarray, i: int) -> float:
    return float((values[i - 1] + values[i]) / 2)


# ---------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("vocab_size", [7, 1000, 32000, 32001, 32064, 50257, 128257, 151936])
def test_greedy_mode_is_argmax(vocab_size):
    rng = np.random.default_rng(vocab_size)
    logits = rng.standard_normal((3, vocab_size)).astype(np.float32)
    logits[1] = rng.integers(0, 4, vocab_size)  # many ties: the lowest index wins
    logits[2, -1] = 100.0                       # the max in the (possibly ragged) last chunk
    out = sample_jit(jnp.asarray(logits), None, mode="greedy")
    np.testing.assert_array_equal(out.tokens, jnp.argmax(jnp.asarray(logits), -1))
    assert out.tokens.dtype == jnp.int32 and out.top_ids.shape == (3, 0)


def test_greedy_argmax_ties_take_lowest_index():
    vocab_size = 128257  # odd: the last chunk is ragged and overlaps its neighbour
    x = np.zeros((5, vocab_size), np.float32)
    x[0, [vocab_size - 1, vocab_size - 300]] = 1.0  # the earlier chunk wins
    x[1, [vocab_size - 2, vocab_size - 1]] = 1.0    # both in the ragged tail
    x[2, [5, 70000]] = 1.0
    x[3, :] = -np.inf                               # nothing finite: index 0, as argmax
    x[4, [9, 10]] = np.nan                          # argmax treats NaN as the max
    got = np.asarray(jax.jit(greedy_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), -1)))
    np.testing.assert_array_equal(got, [vocab_size - 300, vocab_size - 2, 5, 0, 9])


# ---------------------------------------------------------------------------------------------
# distributions (NUM_DRAWS rows of one fixed seed, one output index each)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    logits = np.random.default_rng(7).uniform(-1.0, 1.0, 10).astype(np.float32)
    tokens = draws(logits, SamplingParams(temperature=temperature))
    assert_matches_distribution(tokens, softmax64(logits.astype(np.float64) / temperature))


# name -> size of the kept set (None: whatever the combination keeps); "wide" ones bisect
FILTER_CASES = {"top_k": 5, "top_k_wide": TOP_CANDIDATES + 36, "top_p": 4, "top_p_wide": TOP_CANDIDATES + 50,
                "min_p": 6, "combined": None}


def _filter_case(name: str, logits: np.ndarray) -> dict:
    """Parameters whose cut-offs fall midway between two tokens (no float boundary cases)."""
    size = FILTER_CASES[name]
    p_sorted = np.sort(softmax64(logits.astype(np.float64)))[::-1]
    if name.startswith("top_k"):
        return {"top_k": size}
    if name.startswith("top_p"):  # mass of the top size-1 < top_p < mass of the top size
        return {"top_p": mid_between(np.cumsum(p_sorted), size - 1)}
    if name == "min_p":  # a threshold between the size-th and next tokens' probability ratio
        return {"min_p": mid_between(p_sorted / p_sorted[0], size)}
    if name == "combined":  # temperature 0.7, top-k 8, then top-p over the renormalised top 8
        z = np.sort(logits.astype(np.float64) / 0.7)[::-1][:8]
        return {"temperature": 0.7, "top_k": 8, "top_p": mid_between(np.cumsum(softmax64(z)), 6),
                "min_p": 0.01}
    raise AssertionError(name)


@pytest.mark.parametrize("name", list(FILTER_CASES))
def test_filters_keep_their_set_and_sample_it_proportionally(name):
    vocab = 2 * TOP_CANDIDATES + 72 if name.endswith("wide") else 32
    logits = np.random.default_rng(11).uniform(-1.5, 1.5, vocab).astype(np.float32)
    if vocab > 32:
        logits /= 6  # flat enough that 4000 draws fill >= 5 per kept token
    kwargs = _filter_case(name, logits)
    tokens = draws(logits, SamplingParams(**kwargs))
    probs = reference_probs(logits, **kwargs)
    if FILTER_CASES[name] is not None:
        assert (probs > 0).sum() == FILTER_CASES[name]
    assert_matches_distribution(tokens, probs)


def test_filter_kept_sets_match_reference_on_random_rows():
    """Many (top_k, top_p, min_p) rows, both inside TOP_CANDIDATES and past it (bisection)."""
    rng = np.random.default_rng(17)
    batch, vocab = 64, 3 * TOP_CANDIDATES + 13
    scale = np.where(np.arange(batch) % 2 == 0, 0.3, 3.0)[:, None]  # flat rows: wide nuclei
    logits = (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)
    top_ks = [0, 3, TOP_CANDIDATES, TOP_CANDIDATES + 1, 150, vocab + 5]
    params = [SamplingParams(top_k=int(rng.choice(top_ks)),
                             top_p=float(rng.choice([1.0, rng.uniform(0.05, 0.99)])),
                             min_p=float(rng.choice([0.0, 0.0, rng.uniform(0.0, 0.5)])))
              for _ in range(batch)]
    md = metadata(params)
    kept = np.isfinite(np.asarray(jax.jit(filter_logits)(jnp.asarray(logits), md)))
    sizes = []
    for i, p in enumerate(params):
        want = reference_probs(logits[i], top_k=p.top_k, top_p=p.top_p, min_p=p.min_p) > 0
        np.testing.assert_array_equal(kept[i], want, err_msg=f"row {i}: {p}")
        sizes.append(int(want.sum()))
    assert max(sizes) > TOP_CANDIDATES + 20 and min(sizes) < 10  # both paths were exercised


def test_filter_keeps_every_token_tied_with_the_cutoff():
    logits = jnp.asarray([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    kept = jax.jit(filter_logits)(logits, metadata([SamplingParams(top_k=2)]))
    np.testing.assert_array_equal(np.isfinite(kept[0]), [True, True, True, True, False, False])


def test_top_p_always_keeps_the_top_token():
    logits = np.random.default_rng(3).uniform(-1.0, 1.0, 32).astype(np.float32)
    logits[17] = 8.0  # holds > 99% of the mass, yet top_p = 1e-6 must still keep it
    tokens = draws(logits, SamplingParams(top_p=1e-6))
    assert (tokens == 17).all()


# ---------------------------------------------------------------------------------------------
# penalties


def test_penalties_hand_checked():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 1.5, 0.0]] * 3, np.float32)
    prompt, output = [0, 3], [2, 2, 3, 5]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(temperature=0.0),                          # no penalties: unchanged
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # history [0] then -1 padding
    ]
    md = metadata(params, histories=[prompt + output, prompt + output, [0]], prompt_lens=[2, 2, 1], width=8)
    # Row 0 by hand. Repetition (seen in prompt or output: 0, 2, 3, 5): 2/2, 0.5/2, -0.5*2, 0*2.
    #   -> [1.0, -1.0, 0.25, -1.0, 1.5, 0.0]
    # Output counts {2: 2, 3: 1, 5: 1}; token 0 is prompt-only, so no frequency/presence for it.
    #   token 2: 0.25 - 0.5*2 - 0.25 = -1.0; token 3: -1.0 - 0.5 - 0.25 = -1.75; token 5: 0 - 0.5 - 0.25
    expected = np.array([
        [1.0, -1.0, -1.0, -1.75, 1.5, -0.75],
        [2.0, -1.0, 0.5, -0.5, 1.5, 0.0],
        [1.0, -1.0, 0.5, -0.5, 1.5, 0.0],  # the -1 padding must not penalise token 5 (V - 1)
    ])
    np.testing.assert_allclose(penalties_jit(jnp.asarray(logits), md), expected, rtol=0, atol=1e-6)
    out = sample_jit(jnp.asarray(logits), md, mode="full")
    np.testing.assert_array_equal(out.tokens, [4, 0, 4])  # penalties move rows 0 and 2 off token 0
    assert out.top_ids.shape == (3, 6)  # num_top_logprobs is capped at the vocabulary size


def reference_penalties(logits, history, prompt_len, rep, freq, pres):
    out = logits.astype(np.float64).copy()
    seen = {t for t in history}
    counts = np.bincount(np.asarray(history[prompt_len:], int), minlength=logits.size)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    return out - freq * counts - pres * (counts > 0)


def test_penalties_match_reference_on_random_rows():
    rng = np.random.default_rng(5)
    batch, vocab, width = 6, 50, 24
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    histories = [list(rng.integers(0, vocab, rng.integers(0, width + 1))) for _ in range(batch)]
    prompt_lens = [int(rng.integers(0, len(h) + 1)) for h in histories]
    params = [SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2.0)),
                             frequency_penalty=float(rng.uniform(-2, 2)),
                             presence_penalty=float(rng.uniform(-2, 2))) for _ in range(batch)]
    md = metadata(params, histories=histories, prompt_lens=prompt_lens, width=width, batch=8)
    got = np.asarray(penalties_jit(jnp.asarray(np.pad(logits, ((0, 2), (0, 0)))), md))[:batch]
    for i, p in enumerate(params):
        want = reference_penalties(logits[i], histories[i], prompt_lens[i], p.repetition_penalty,
                                   p.frequency_penalty, p.presence_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_temperature_zero_rows_in_a_full_batch_are_argmax_of_penalised_logits():
    rng = np.random.default_rng(9)
    batch, vocab, width = 8, 64, 16
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    histories = [list(rng.integers(0, vocab, width)) for _ in range(batch)]
    greedy_rows = [0, 3, 4, 7]
    params = [SamplingParams(temperature=0.0 if i in greedy_rows else 1.3, top_k=3, top_p=0.5,
                             repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
              for i in range(batch)]
    md = metadata(params, seeds=list(range(batch)), histories=histories, prompt_lens=[4] * batch, width=width)
    tokens = np.asarray(sample_jit(jnp.asarray(logits), md, mode="full").tokens)
    for i in greedy_rows:
        want = reference_penalties(logits[i], histories[i], 4, 1.5, 1.0, 0.5)
        assert tokens[i] == np.argmax(want)
    assert any(tokens[i] != np.argmax(logits[i]) for i in greedy_rows)  # the penalties mattered


# ---------------------------------------------------------------------------------------------
# logprobs


def test_raw_logprobs_and_top_ids():
    rng = np.random.default_rng(13)
    batch, vocab = 6, 1000
    logits = (3 * rng.standard_normal((batch, vocab))).astype(np.float32)
    params = [SamplingParams(temperature=t, top_k=k, repetition_penalty=1.3, frequency_penalty=0.4)
              for t, k in zip([0.0, 0.3, 1.0, 1.7, 0.8, 0.0], [0, 5, 50, 0, 1, 0])]
    histories = [list(rng.integers(0, vocab, 10)) for _ in range(batch)]
    md = metadata(params, seeds=list(range(batch)), histories=histories, width=10)
    out = sample_jit(jnp.asarray(logits), md, mode="full")
    want = jax.nn.log_softmax(logits.astype(np.float64), axis=-1)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprob, want[np.arange(batch), tokens], rtol=0, atol=1e-5)
    top = np.argsort(-logits, axis=-1)[:, :MAX_LOGPROBS]  # raw logits: penalties don't move them
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(want, top, -1), rtol=0, atol=1e-5)
    small = sample_jit(jnp.asarray(logits), md, mode="full", num_top_logprobs=3)
    np.testing.assert_array_equal(small.top_ids, top[:, :3])
    np.testing.assert_array_equal(small.tokens, out.tokens)
    none = jax.eval_shape(lambda x: sample(x, md, mode="full", num_top_logprobs=0), jnp.asarray(logits))
    assert none.top_ids.shape == none.top_logprobs.shape == (batch, 0)


# ---------------------------------------------------------------------------------------------
# batch independence


def test_seeded_row_ignores_batch_composition_and_position():
    rng = np.random.default_rng(21)
    vocab, steps = 512, 40
    params = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, min_p=0.001, repetition_penalty=1.1,
                            frequency_penalty=0.2, presence_penalty=0.1, seed=2**40 + 7)
    history = list(rng.integers(0, vocab, 12))
    alone, batched = [], []
    for step in range(steps):
        logits = rng.standard_normal(vocab).astype(np.float32)
        md = metadata([params], seeds=[params.seed], output_index=[step], histories=[history],
                      prompt_lens=[8], width=16)
        alone.append(int(sample_jit(jnp.asarray(logits[None]), md, mode="full").tokens[0]))
        batched.append(_in_random_batch(rng, params, step, logits, history, position=step % 8))
    assert alone == batched
    assert len(set(alone)) > steps // 2  # the output index really changes the draw


def _in_random_batch(rng, params, step, logits, history, position, batch=8, width=32):
    others = [SamplingParams(temperature=float(rng.uniform(0, 2)), top_k=int(rng.integers(0, 20)),
                             top_p=float(rng.uniform(0.1, 1)),
                             repetition_penalty=float(rng.uniform(0.8, 1.5)))
              for _ in range(batch - 1)]
    rows_params = others[:position] + [params] + others[position:]
    seeds = [int(s) for s in rng.integers(0, 2**32, batch)]
    seeds[position] = params.seed
    indices = [int(i) for i in rng.integers(0, 1000, batch)]
    indices[position] = step
    histories = [list(rng.integers(0, logits.size, rng.integers(0, width))) for _ in range(batch)]
    histories[position] = history
    prompt_lens = [len(h) // 2 for h in histories]
    prompt_lens[position] = 8
    md = metadata(rows_params, seeds=seeds, output_index=indices, histories=histories,
                  prompt_lens=prompt_lens, width=width)
    batch_logits = rng.standard_normal((batch, logits.size)).astype(np.float32)
    batch_logits[position] = logits
    return int(sample_jit(jnp.asarray(batch_logits), md, mode="full").tokens[position])


# ---------------------------------------------------------------------------------------------
# host helpers


def test_build_sampling_metadata_pads_rows_greedy():
    md = metadata([SamplingParams(temperature=0.5, top_k=3, seed=9)], seeds=[2**40 + 1],
                  output_index=[4], histories=[[5, 6, 7]], prompt_lens=[2], batch=4, width=6)
    assert md.history.shape == (4, 6) and md.history.dtype == np.int32 and md.seed.dtype == np.uint32
    np.testing.assert_array_equal(md.history[0], [5, 6, 7, -1, -1, -1])
    assert (md.history[1:] == -1).all() and (md.temperature[1:] == 0).all() and (md.top_p[1:] == 1).all()
    assert md.seed[0] == seed_bits(2**40 + 1) != seed_bits(1) and md.output_index[0] == 4
    with pytest.raises(ValueError):
        metadata([SamplingParams()], histories=[[1] * 7], width=6)
    with pytest.raises(ValueError):
        metadata([SamplingParams()] * 3, batch=2)


def test_select_mode():
    assert select_mode([SamplingParams(temperature=0.0)] * 3) == "greedy"
    assert select_mode([SamplingParams(temperature=0.0), SamplingParams()]) == "full"
    assert select_mode([SamplingParams(temperature=0.0, logprobs=0)]) == "full"
    assert select_mode([SamplingParams(temperature=0.0, presence_penalty=0.1)]) == "full"
    with pytest.raises(ValueError, match="mode"):
        sample(jnp.zeros((1, 4)), None, mode="beam")
