"""On-device batched sampling with per-row parameters (vLLM semantics), plus its host-side metadata.

`sample(logits, md, mode=...)` is meant to be jitted by the caller with `mode` (and
`num_top_logprobs`) static. Two modes:

  "greedy"  argmax of the raw logits; nothing else is computed (`md` is not read and may be None).
            `logprob` is zeros and `top_ids` / `top_logprobs` have shape [B, 0]: a batch that needs
            logprobs, penalties or randomness must use "full" (see `select_mode`).
  "full"    repetition / frequency / presence penalties, temperature (rows below GREEDY_TEMPERATURE
            take the argmax of the penalised logits), top-k, top-p, min-p, then a Gumbel-max draw with
            the row's own key, and raw logprobs (log_softmax of the unprocessed logits, as vLLM
            reports by default) with the top `num_top_logprobs` ids and values (ties: lower id
            first; K = min(num_top_logprobs, V)).

A row's randomness is `fold_in(key(seed), output_index)` with the threefry PRNG named explicitly,
and every step is row-wise, so a seeded row's token depends only on its own logits, parameters,
seed and output index: not on the batch it shares or its position in it.

Compilation: one program per (B, V, history width L, logits dtype, mode, num_top_logprobs); all
parameter values are data. Pass md=None in "greedy" mode so L (and a host-to-device copy of the
metadata) stays out of it.
"""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from engine.sampling_params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingParams

MODES = ("greedy", "full")
PRNG_IMPL = "threefry2x32"  # named so tokens don't change with the jax_default_prng_impl flag
HISTORY_PAD = -1
TOP_CANDIDATES = 64  # best logits taken with lax.top_k; top-k / top-p past them bisect
MASK_WORD_BITS = 32  # token bitmasks pack 32 vocabulary ids per uint32 word
ALL_ALLOWED = np.uint32(0xFFFFFFFF)


@dataclasses.dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters as [B] arrays (numpy on the host, jax inside the jit)."""

    temperature: jax.Array        # f32[B]; < GREEDY_TEMPERATURE = greedy
    top_p: jax.Array              # f32[B]; 1 = off
    top_k: jax.Array              # i32[B]; 0 = off
    min_p: jax.Array              # f32[B]; 0 = off
    presence_penalty: jax.Array   # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]; 1 = off
    seed: jax.Array               # u32[B]
    output_index: jax.Array       # i32[B]; index of the token being sampled among the row's outputs
    history: jax.Array            # i32[B, L]; prompt + output tokens so far, padded with HISTORY_PAD
    prompt_len: jax.Array         # i32[B]; history[:, :prompt_len] is the prompt
    allowed: jax.Array            # u32[B, ceil(V / 32)]; bit t % 32 of word t // 32 set = token t may be sampled


@dataclasses.dataclass(slots=True)
class SampleOutput:
    tokens: jax.Array        # i32[B]
    logprob: jax.Array       # f32[B]; raw log_softmax of the chosen token
    top_ids: jax.Array       # i32[B, K]
    top_logprobs: jax.Array  # f32[B, K]


for _cls in (SamplingMetadata, SampleOutput):
    jax.tree_util.register_dataclass(
        _cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


# ---------------------------------------------------------------------------------------------
# Device side


def sample(logits: jax.Array, md: SamplingMetadata | None, *, mode: str,
           num_top_logprobs: int = MAX_LOGPROBS) -> SampleOutput:
    """Sample one token per row of logits f32[B, V]. `mode` and `num_top_logprobs` are static."""
    if mode == "greedy":
        return _greedy_output(logits)
    if mode == "full":
        return _full_output(logits, md, num_top_logprobs)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _greedy_output(logits: jax.Array) -> SampleOutput:
    batch = logits.shape[0]
    return SampleOutput(tokens=greedy_argmax(logits), logprob=jnp.zeros((batch,), jnp.float32),
                        top_ids=jnp.zeros((batch, 0), jnp.int32),
                        top_logprobs=jnp.zeros((batch, 0), jnp.float32))


def _full_output(logits: jax.Array, md: SamplingMetadata, num_top_logprobs: int) -> SampleOutput:
    logits = logits.astype(jnp.float32)
    penalised = mask_tokens(apply_penalties(logits, md), md.allowed)
    greedy_row = md.temperature < GREEDY_TEMPERATURE
    # Greedy rows divide by 1 rather than ~0 (inf / nan); their draw is discarded below.
    scaled = penalised / jnp.where(greedy_row, 1.0, md.temperature)[:, None]
    drawn = _gumbel_argmax(filter_logits(scaled, md), md.seed, md.output_index)
    tokens = jnp.where(greedy_row, greedy_argmax(penalised), drawn)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = _top_logprobs(raw_logprobs, num_top_logprobs)
    return SampleOutput(tokens=tokens, logprob=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def _top_logprobs(raw_logprobs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best raw logprobs and their ids; k is capped at the vocabulary size."""
    batch, vocab_size = raw_logprobs.shape
    k = min(k, vocab_size)
    if k == 0:
        return jnp.zeros((batch, 0), jnp.float32), jnp.zeros((batch, 0), jnp.int32)
    values, ids = jax.lax.top_k(raw_logprobs, k)
    return values, ids.astype(jnp.int32)


def token_counts(md: SamplingMetadata, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(in_prompt bool[B, V], output_counts i32[B, V]) from the padded history, on device."""
    batch, width = md.history.shape
    position = jnp.arange(width, dtype=jnp.int32)[None, :]
    is_output = position >= md.prompt_len[:, None]
    # Padding goes to column V, which mode="drop" discards (a raw -1 would wrap to V - 1).
    ids = jnp.where(md.history >= 0, md.history, vocab_size)
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], ids.shape)
    zeros = jnp.zeros((batch, vocab_size), jnp.int32)
    output_counts = zeros.at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    prompt_counts = zeros.at[rows, ids].add((~is_output).astype(jnp.int32), mode="drop")
    return prompt_counts > 0, output_counts


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM order: repetition (prompt or output tokens), then frequency and presence (output only)."""
    in_prompt, output_counts = token_counts(md, logits.shape[-1])
    in_output = output_counts > 0
    rep = md.repetition_penalty[:, None]
    # Dividing a positive logit and multiplying a negative one both make the token less likely.
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(in_prompt | in_output, repeated, logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * in_output.astype(jnp.float32)


def mask_tokens(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf wherever a row's bitmask clears the token's bit. A bitmask (not a list of banned ids) has one
    shape for any number of ids, so no request can outgrow it. Bits past V (a wider mask) are ignored."""
    batch, vocab_size = logits.shape
    shifts = jnp.arange(MASK_WORD_BITS, dtype=jnp.uint32)
    bits = (allowed[:, :, None] >> shifts) & jnp.uint32(1)          # [B, W, 32]
    bits = bits.reshape(batch, -1)[:, :vocab_size]
    return jnp.where(bits == 1, logits, -jnp.inf)


def filter_logits(scaled: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Top-k, then top-p, then min-p on temperature-scaled logits; dropped tokens become -inf.

    Each keeps a prefix of the descending order, so each reduces to a per-row cut-off and the
    mask is applied in vocabulary order (tokens tied with a cut-off are all kept). No full sort:
    XLA CPU sorts [B, V] in seconds. The TOP_CANDIDATES best logits (lax.top_k) settle the usual
    cases exactly; rows whose k or nucleus reaches past them bisect on the logits' bit patterns.
    """
    # -0.0 and +0.0 compare equal as floats but not as keys; make them one key.
    scaled = jnp.where(scaled == 0, 0.0, scaled)
    keys = sortable_keys(scaled)
    candidates = top_candidates(scaled)
    top_k_cut = _top_k_cutoff(keys, candidates, md.top_k)
    top_p_cut = _top_p_cutoff(scaled, keys, candidates, top_k_cut, md.top_p)
    # p < min_p * p_max  <=>  logit < max_logit + log(min_p); renormalisation cancels out.
    min_p_cut = sortable_keys(candidates[:, 0] + jnp.log(md.min_p))
    cut = jnp.maximum(top_p_cut, min_p_cut)  # top_p_cut >= top_k_cut by construction
    return jnp.where(keys >= cut[:, None], scaled, -jnp.inf)


def top_candidates(scaled: jax.Array) -> jax.Array:
    """The TOP_CANDIDATES largest logits per row, descending."""
    values = jax.lax.top_k(scaled, min(TOP_CANDIDATES, scaled.shape[-1]))[0]
    # Without the barrier XLA CPU rewrites top_k followed by a slice into a full sort of [B, V], orders of
    # magnitude slower at a real vocabulary.
    return jax.lax.optimization_barrier(values)


def sortable_keys(x: jax.Array) -> jax.Array:
    """u32 keys ordered as the f32 values (radix-sort trick): flip negatives, set positives' sign bit."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _top_k_cutoff(keys: jax.Array, candidates: jax.Array, top_k: jax.Array) -> jax.Array:
    """The key of each row's k-th largest logit (the row minimum when top-k is off)."""
    vocab_size, num_candidates = keys.shape[-1], candidates.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    lowest = keys.min(axis=-1)
    among_candidates = k <= num_candidates
    kth = jnp.take_along_axis(candidates, (jnp.minimum(k, num_candidates) - 1)[:, None], axis=-1)[:, 0]
    settled = jnp.where(k == vocab_size, lowest, sortable_keys(kth))
    # Unsettled rows (num_candidates < k < V): the k-th largest is at or below the last candidate.
    done = among_candidates | (k == vocab_size)
    hi = jnp.where(done, settled, sortable_keys(candidates[:, -1]))
    lo = jnp.where(done, settled, lowest)
    return largest_passing(lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k, lo, hi)


def _top_p_cutoff(scaled, keys, candidates, top_k_cut, top_p) -> jax.Array:
    """The key of the last token of the smallest top-k prefix whose probability mass >= top_p."""
    row_max = candidates[:, :1]
    weights = jnp.where(keys >= top_k_cut[:, None], jnp.exp(scaled - row_max), 0.0)
    target = top_p * jnp.sum(weights, axis=-1)

    def reaches_target(t):
        return jnp.sum(jnp.where(keys >= t[:, None], weights, 0.0), axis=-1) >= target

    candidate_keys = sortable_keys(candidates)
    candidate_mass = jnp.cumsum(jnp.where(candidate_keys >= top_k_cut[:, None],
                                          jnp.exp(candidates - row_max), 0.0), axis=-1)
    # Mass strictly before a rank < target <=> that rank is in the nucleus; rank 0 always is.
    mass_before = jnp.pad(candidate_mass[:, :-1], ((0, 0), (1, 0)))
    # At least the top token: a top_p that underflows float32 makes the target 0, which no mass is below.
    in_nucleus = jnp.maximum(jnp.sum(mass_before < target[:, None], axis=-1), 1)
    settled = jnp.take_along_axis(candidate_keys, (in_nucleus - 1)[:, None], axis=-1)[:, 0]
    # top_p == 1 keeps the whole top-k set outright: rounding could otherwise cut its tail.
    off = top_p >= 1.0
    done = off | (candidate_mass[:, -1] >= target)
    settled = jnp.where(off, top_k_cut, settled)
    lo = jnp.where(done, settled, top_k_cut)
    # max(): a top-k set inside the candidates that missed the target only by rounding keeps it all.
    hi = jnp.where(done, settled, jnp.maximum(candidate_keys[:, -1], top_k_cut))
    return largest_passing(reaches_target, lo, hi)


def largest_passing(passes, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest u32 key t in [lo, hi] with passes(t), for passes true at lo and monotone.

    Rows with lo == hi are settled and cost nothing but the loop's trip count, which is the
    slowest row's (at most 32: one bit per trip); a batch with no unsettled row makes no trip.
    """
    def unsettled(state):
        return jnp.any(state[0] < state[1])

    def halve(state):
        lo, hi = state
        mid = hi - ((hi - lo) >> 1)  # in (lo, hi] when lo < hi, and no u32 overflow
        ok = passes(mid)
        active = lo < hi
        return jnp.where(active & ok, mid, lo), jnp.where(active & ~ok, mid - 1, hi)

    return jax.lax.while_loop(unsettled, halve, (lo, hi))[0]


def _gumbel_argmax(logits: jax.Array, seed: jax.Array, output_index: jax.Array) -> jax.Array:
    """A categorical draw per row: argmax(logits + Gumbel noise from that row's own key)."""
    vocab_size = logits.shape[-1]

    def noise(row_seed, row_index):
        key = jax.random.fold_in(jax.random.key(row_seed, impl=PRNG_IMPL), row_index)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return greedy_argmax(logits + jax.vmap(noise)(seed, output_index))


def greedy_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, -1) as i32, lowest index on ties (and on NaN), but much faster on XLA CPU.

    The max of each chunk of the vocabulary, then the first chunk holding the row max, then the
    first max inside that chunk. XLA CPU lowers a plain argmax over a wide axis to a slow
    variadic reduce; two max-reductions and a [B, chunk] gather are far cheaper.
    """
    batch, vocab_size = x.shape
    chunk = _argmax_chunk(vocab_size)
    if chunk >= vocab_size:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    whole = vocab_size // chunk
    chunk_max = x[:, :whole * chunk].reshape(batch, whole, chunk).max(axis=-1)
    if vocab_size % chunk:
        chunk_max = jnp.concatenate([chunk_max, x[:, whole * chunk:].max(axis=-1, keepdims=True)], -1)
    best_chunk = jnp.argmax(chunk_max, axis=-1).astype(jnp.int32)
    # The ragged last chunk is read as the final `chunk` columns; the overlap lies in earlier
    # chunks, whose maxima are strictly smaller (else argmax would have picked one of them).
    start = jnp.minimum(best_chunk * chunk, vocab_size - chunk)
    window = jnp.take_along_axis(x, start[:, None] + jnp.arange(chunk, dtype=jnp.int32), axis=-1)
    return start + jnp.argmax(window, axis=-1).astype(jnp.int32)


def _argmax_chunk(vocab_size: int) -> int:
    # On XLA CPU a chunk that divides V avoids a slow slice copy of the logits; real
    # vocabularies are multiples of 64 or more (32000, 32064, 128256, 151936, 256000).
    chunk = 256
    while chunk > 64 and vocab_size % chunk:
        chunk //= 2
    return chunk if vocab_size % chunk == 0 else 256


# ---------------------------------------------------------------------------------------------
# Host side

GREEDY = SamplingParams(temperature=0.0)


class SamplingRow(NamedTuple):
    """One request's sampling state for this step (a plain 5-tuple in the same order works too)."""

    params: SamplingParams
    seed: int                 # the request's seed, or one the engine drew for it
    output_index: int         # how many output tokens the request has so far
    history: Sequence[int]    # prompt + output token ids so far
    prompt_len: int
    banned: Sequence[int] = ()  # ids not to sample this step (EOS / stop ids before min_tokens), in [0, V)
    allowed: np.ndarray | None = None  # u32[ceil(V / 32)]: the only ids that may be sampled (a grammar's), or None


def needs_full_sampler(p: SamplingParams) -> bool:
    """Whether these params need randomness, penalties or logprobs (the full sampler), or argmax does."""
    return not p.is_greedy or p.has_penalties or p.logprobs is not None


def select_mode(params: Iterable[SamplingParams]) -> str:
    """"greedy" only when no row needs randomness, penalties or logprobs; else "full"."""
    return "full" if any(needs_full_sampler(p) for p in params) else "greedy"


def row_needs_full_sampler(state, grammar_bitmasks: dict) -> bool:
    """Whether a row of `state` (a worker's CachedRequestState) needs the full sampler this step (randomness,
    penalties, logprobs, banned ids, or a grammar's mask on a kept token), or plain argmax serves it."""
    return (state.needs_full_sampler or bool(state.min_tokens and state.banned_token_ids)
            or state.req_id in grammar_bitmasks)


def sampler_mode(rows, grammar_bitmasks: dict) -> str:
    """The sampler program for `rows` ((state, history_len) pairs): "full" if any row needs it, else "greedy".
    Asked of every row of every step, so rows known to be plain argmax skip the question."""
    return "full" if any(row_needs_full_sampler(s, grammar_bitmasks) for s,
                         _ in rows if not s.plain_argmax) else "greedy"


def sampling_row(state, history_len: int, grammar_bitmasks: dict) -> SamplingRow:
    """A row's SamplingRow: `state` (a CachedRequestState) sampling after its first `history_len` tokens."""
    params = state.params or GREEDY
    # The token history only feeds the penalties: copying prompt + outputs for every row every step
    # would be O(context) host work that the greedy path throws away.
    if params.has_penalties:  # a mid-prompt chunk's history is part of the prompt (its draw is discarded)
        history = state.token_ids(0, history_len)
        prompt_len = min(state.num_prompt_tokens, history_len)
    else:
        history, prompt_len = (), 0
    # The draw's index among the outputs from history_len, not the request's list: under async scheduling
    # a decode row runs one token ahead of its request's outputs (the same in a synchronous step).
    output_index = max(0, history_len - state.num_prompt_tokens)
    # A grammar's mask: the scheduler sends it for the rows whose token is kept (it reaches the end of the
    # request's tokens; a mid-prompt chunk's, or a recompute's re-prefill of its outputs, is discarded).
    return SamplingRow(params, state.seed, output_index, history, prompt_len, state.banned_token_ids,
                       grammar_bitmasks.get(state.req_id))


def fetch_sample(sample, mode: str) -> tuple:
    """A SampleOutput's arrays on the host: (tokens, logprob, top_ids, top_logprobs). A greedy one fetches
    only its tokens (the rest is constant: _greedy_output), and without jax.device_get, which costs more than
    np.asarray of one array for four tiny arrays."""
    if mode == "greedy":
        tokens = np.asarray(sample.tokens)
        rows = tokens.shape[0]
        return tokens, np.zeros(rows, np.float32), np.zeros((rows, 0), np.int32), np.zeros((rows, 0), np.float32)
    return jax.device_get((sample.tokens, sample.logprob, sample.top_ids, sample.top_logprobs))


def build_sampling_metadata(rows: Sequence[SamplingRow | tuple], batch: int, width: int,
                            vocab_size: int) -> SamplingMetadata:
    """Numpy SamplingMetadata for `rows`, padded to `batch` rows (greedy) and history width `width`."""
    if len(rows) > batch:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {batch}")
    md = _padding_metadata(batch, width, vocab_size)
    for i, row in enumerate(rows):
        _fill_row(md, i, SamplingRow(*row), width)
    return md


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // MASK_WORD_BITS)


def clear_bits(mask_row: np.ndarray, token_ids) -> None:
    """Disallow `token_ids` in one row's bitmask (u32[ceil(V / 32)]), in place."""
    ids = np.asarray(token_ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= mask_row.size * MASK_WORD_BITS):
        raise ValueError(f"token ids {ids.tolist()[:5]} are outside the vocabulary")
    np.bitwise_and.at(mask_row, ids // MASK_WORD_BITS, ~(np.uint32(1) << (ids % MASK_WORD_BITS).astype(np.uint32)))


def _padding_metadata(batch: int, width: int, vocab_size: int) -> SamplingMetadata:
    def full(value, dtype):
        return np.full((batch,), value, dtype)

    return SamplingMetadata(
        temperature=full(0.0, np.float32), top_p=full(1.0, np.float32), top_k=full(0, np.int32),
        min_p=full(0.0, np.float32), presence_penalty=full(0.0, np.float32),
        frequency_penalty=full(0.0, np.float32), repetition_penalty=full(1.0, np.float32),
        seed=full(0, np.uint32), output_index=full(0, np.int32),
        history=np.full((batch, width), HISTORY_PAD, np.int32), prompt_len=full(0, np.int32),
        allowed=np.full((batch, mask_words(vocab_size)), ALL_ALLOWED, np.uint32))


def _fill_row(md: SamplingMetadata, i: int, row: SamplingRow, width: int):
    p = row.params
    if len(row.history) > width:
        raise ValueError(f"history of {len(row.history)} tokens does not fit width {width}")
    if not 0 <= row.prompt_len <= len(row.history):
        raise ValueError(f"prompt_len {row.prompt_len} is outside the history of {len(row.history)}")
    md.temperature[i] = p.temperature
    md.top_p[i] = p.top_p
    md.top_k[i] = p.top_k
    md.min_p[i] = p.min_p
    md.presence_penalty[i] = p.presence_penalty
    md.frequency_penalty[i] = p.frequency_penalty
    md.repetition_penalty[i] = p.repetition_penalty
    md.seed[i] = seed_bits(row.seed)
    md.output_index[i] = row.output_index
    md.history[i, :len(row.history)] = row.history
    md.prompt_len[i] = row.prompt_len
    if row.allowed is not None:
        md.allowed[i] &= row.allowed
    clear_bits(md.allowed[i], row.banned)


def seed_bits(seed: int) -> int:
    """A [0, 2**63) seed folded to the 32 bits the device key takes (both halves contribute)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF
