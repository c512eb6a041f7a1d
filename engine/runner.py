"""ModelRunner: executes a StepPlan on the device.

The scheduler decides; the runner does. Per plan it (1) copies swapped-out blocks to host memory,
(2) copies swapped-in blocks back, (3) runs the prefill chunks and the decode batch in one ragged call
(a step that only decodes: a decode call), a jitted call over bucketed shapes with the cache donated,
and returns one sampled token per request that samples this step. `warmup()` compiles every bucket up
front; after it, `compile_guard` makes any new compilation an error (the tpu-inference guard).
"""

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import pathlib
import threading
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from tqdm import tqdm

from engine.packing import DecodeRows, SeqSlice, StepLayout, bucket, pack
from engine.sampler import SamplingRow, build_sampling_metadata, needs_full_sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import DecodeTokens
from engine.step import prompt_logprobs_step, sample_step
from models.loading import LoadedModel
from models.paged import NULL_BLOCK, init_kv_cache, write_blocks
from models.sharding import kv_cache_sharding, make_mesh
from models.transformer import StaticGraphDef
from pallas_kernels import native

log = logging.getLogger("ferry")

MIN_PREFILL_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass(slots=True)
class RunnerOutput:
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> sampled token
    # request id -> (logprob of the sampled token, [(id, logprob), ...] top-k), for requests asking logprobs
    logprobs: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # request id -> (prompt position of the first, [(logprob of that prompt token, top-k), ...]) for this step's
    # scored prompt rows
    prompt_logprobs: dict[str, tuple[int, list]] = dataclasses.field(default_factory=dict)

    # The decode batch's tokens and stop mask, when it ran in one call (not in `tokens`: postprocess's fast path)
    decoded: DecodeTokens | None = None

    def update(self, other: "RunnerOutput") -> None:
        """Fold in a run of part of the step (fault isolation): its decode tokens too, by request id."""
        self.tokens.update(other.tokens)
        if other.decoded is not None:
            self.tokens.update(zip([r.request_id for r in other.decoded.requests], other.decoded.tokens))
        self.logprobs.update(other.logprobs)
        self.prompt_logprobs.update(other.prompt_logprobs)


@dataclasses.dataclass(slots=True)
class DecodeFlight:
    """A decode call dispatched but not landed (async scheduling): what `ModelRunner.land` needs."""
    requests: list      # the batch as planned (StepPlan.decodes)
    sample: object      # its on-device SampleOutput
    mode: str           # the sampler it ran
    plain: bool         # every row plain argmax: no logprobs to collect
    packed: tuple       # DecodeRows.packed_rows() of its pack
    generations: np.ndarray  # i64[n]: its rows' generations at dispatch (DecodeRows.landed)


def _needs_full_sampler(request, history_len: int) -> bool:
    """Whether the request's row needs the full sampler (randomness, penalties, logprobs, banned ids, or
    a grammar's mask on a kept token: see ModelRunner._sampling_row), or plain argmax does."""
    if request.needs_full_sampler is None:  # once per request: its params don't change
        request.needs_full_sampler = request.params is not None and needs_full_sampler(request.params)
        request.plain_argmax = not (request.needs_full_sampler or request.min_tokens or request.grammar is not None)
    return (request.needs_full_sampler or bool(request.min_tokens and request.banned_token_ids)
            or (request.grammar is not None and history_len == request.num_tokens))


def _sampler_mode(rows) -> str:
    """The sampler program for `rows` ((request, history_len) pairs): "full" if any row needs it, else "greedy".
    Asked of every row of every step, so rows known to be plain argmax skip the question."""
    return "full" if any(_needs_full_sampler(r, n) for r, n in rows if r.plain_argmax is not True) else "greedy"


def fetch_sample(sample, mode: str) -> tuple:
    """A SampleOutput's arrays on the host: (tokens, logprob, top_ids, top_logprobs). A greedy one fetches
    only its tokens (the rest is constant: sampler._greedy_output), and without jax.device_get, which
    costs ~0.4 ms a step on CPU for four tiny arrays (np.asarray of one: ~0.05 ms)."""
    if mode == "greedy":
        tokens = np.asarray(sample.tokens)
        rows = tokens.shape[0]
        return tokens, np.zeros(rows, np.float32), np.zeros((rows, 0), np.int32), np.zeros((rows, 0), np.float32)
    return jax.device_get((sample.tokens, sample.logprob, sample.top_ids, sample.top_logprobs))


def _select_rows(sample, rows):
    return tuple(a[rows] for a in sample)


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2lo, ... up to the first power of two >= hi."""
    out, n = [], bucket(lo)
    while True:
        out.append(n)
        if n >= hi:
            return out
        n *= 2


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    decode_batch: tuple[int, ...]     # decode rows
    prefill_tokens: tuple[int, ...]   # flat token rows of a prefill call
    # its sequences: the step's decodes (one row each), then its prefill chunks; a scored prompt's call the first
    prefill_seqs: tuple[int, ...]
    width: int                        # block-table width: every sequence's most pages. One width:
                                      # the kernels loop over the pages a sequence uses, not the table
    swap_blocks: tuple[int, ...]      # blocks per swap copy

    @classmethod
    def make(cls, max_num_seqs, max_num_batched_tokens, max_blocks_per_seq, max_prefill_seqs=8):
        return cls(tuple(powers_of_two(1, max_num_seqs)),
                   tuple(powers_of_two(MIN_PREFILL_TOKENS, max_num_batched_tokens)),
                   tuple(powers_of_two(min(max_num_seqs, max_prefill_seqs), max_num_seqs)), max_blocks_per_seq,
                   tuple(powers_of_two(1, max_blocks_per_seq)))

    def pick(self, sizes, n):
        for size in sizes:
            if size >= n:
                return size
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")

    def decode_layout(self, rows: int) -> StepLayout:
        return StepLayout(rows, rows, self.width, rows, decode=True)

    def prefill_layout(self, tokens: int, seqs: int | None = None, all_logits: bool = False) -> StepLayout:
        seqs = seqs or self.prefill_seqs[0]
        return StepLayout(tokens, seqs, self.width, tokens if all_logits else seqs, decode=False)

    def decode_layouts(self, min_rows: int = 0) -> list[StepLayout]:
        """The decode layouts of at least `min_rows` rows, smallest first."""
        return [self.decode_layout(rows) for rows in self.decode_batch if rows >= min_rows]

    def prefill_layouts(self, min_tokens: int = 0, min_seqs: int = 0) -> list[StepLayout]:
        """The plain prefill layouts of at least `min_tokens` token rows and `min_seqs` sequences, smallest first
        (by tokens, then sequences). A call has at most one sequence per token row."""
        return [self.prefill_layout(tokens, seqs) for tokens in self.prefill_tokens if tokens >= min_tokens
                for seqs in self.prefill_seqs if seqs >= min_seqs and (seqs == self.prefill_seqs[0] or seqs <= tokens)]

    def step_layouts(self) -> list[StepLayout]:
        """Every layout a plain (not prompt-scoring) step can take: what warm-up compiles."""
        return self.decode_layouts() + self.prefill_layouts()


@functools.cache
def ferry_source_hash() -> str:
    """A hash of the code that shapes the compiled programs (engine/, models/, pallas_kernels/: Python and C++)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in ("engine", "models", "pallas_kernels"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cc"):
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def warm_records_dir() -> pathlib.Path | None:
    """Where warm-up records go (ModelRunner._warm_record): inside JAX's persistent compilation cache, so
    emptying the cache empties them too. None while the cache is off."""
    cache_dir = jax.config.jax_compilation_cache_dir
    return pathlib.Path(cache_dir) / "ferry-warm" if cache_dir else None


# ------------------------------------------------------------------ swap copies

@jax.jit
def _gather_blocks(kv_cache, block_ids):
    """Every layer's pages `block_ids`: ([L, n, ...], [L, n, ...])."""
    return tuple(pages[:, block_ids] for pages in kv_cache)


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _scatter_blocks(kv_cache, block_ids, blocks, native_write: bool):
    # Padded entries of block_ids are the null block: whatever they carry lands there, harmlessly.
    return tuple(write_blocks(pages, block_ids, new, native_write) for pages, new in zip(kv_cache, blocks))


def host_memory_sharding(mesh):
    """The cache's sharding in pinned host memory where every device has it (GPU, TPU, recent CPU), else
    None (numpy: single-process only)."""
    if all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in mesh.devices.flat):
        return kv_cache_sharding(mesh, memory_kind="pinned_host")
    return None


class ModelRunner:
    def __init__(self, model: LoadedModel, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype=None, attention_impl=None,
                 mesh: jax.sharding.Mesh | None = None):
        """`model` is already placed on `mesh` (models.sharding.shard_model); None: one device, the default."""
        cfg = model.cfg
        self.model, self.block_size, self.attention_impl = model, block_size, attention_impl
        self.graphdef = StaticGraphDef.of(model.graphdef)  # the jitted steps' static argument, hashed once
        self.kv_dtype = jnp.dtype(kv_dtype or model.dtype)
        self.mesh = mesh or make_mesh(jax.devices()[:1])
        self.device_sharding = kv_cache_sharding(self.mesh)
        # Committed to the device from the start: every later cache (step or swap output) is too, so
        # the jitted step sees one input placement and compiles each shape once.
        self.kv_cache = jax.jit(  # zeros made in place on each device: no full copy of the cache anywhere
            functools.partial(init_kv_cache, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                              self.kv_dtype),
            out_shardings=(self.device_sharding, self.device_sharding))()
        self.buckets = Buckets.make(max_num_seqs, max_num_batched_tokens, math.ceil(max_model_len / block_size))
        self.decode_rows = DecodeRows(max_num_seqs, self.buckets.width, block_size, max_model_len)
        # i32[largest decode batch]: the last decode call's tokens, left on the device (sample_step's `fed`)
        self.fed = jax.jit(lambda: jnp.zeros(self.buckets.decode_batch[-1], jnp.int32),
                           out_shardings=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))()
        self.host_sharding = host_memory_sharding(self.mesh)
        # Swap-ins write through the native row write on one CPU device (models.paged.write_blocks)
        self._native_swap_in = self.mesh.size == 1 and jax.default_backend() == "cpu" and native.available()
        self.swapped: dict[tuple[int, ...], list] = {}  # host block ids -> the blocks' contents in host memory
        self.timings = {"device_s": 0.0, "pack_s": 0.0}
        self._background: threading.Thread | None = None  # warm-up's background compiles, if any
        self.warmup_split = (0, 0)  # the last warm-up's step programs: (compiled before it returned, left to the thread)
        self._stop_background = threading.Event()
        # While a cold lazy warm-up compiles on its thread: the (layout, sampler) programs compiled so far,
        # which steps pad up to (layout_for). None: every program is there, or compiles when first used.
        self._ready: set[tuple[StepLayout, str]] | None = None
        # Multi-host (engine/multihost.py): publish(op, args) tells the other processes to make the same
        # device call, `getattr(runner, op)(*args)`, so all enter the same programs in the same order.
        self.publish = None

    def _device_call(self, op: str, *args):
        if self.publish is not None:
            self.publish(op, args)
        return getattr(self, op)(*args)

    # -------------------------------------------------------------- plan execution

    def execute(self, plan) -> "RunnerOutput":
        """Run one StepPlan: swaps first, then the prefill chunks, then the decode batch."""
        self.swap(plan)
        return self.run(plan.prefills, plan.decodes)

    def swap(self, plan) -> None:
        """The plan's block copies, swap-outs first: those device blocks may be reused by swap-ins."""
        for device_ids, host_ids in plan.swap_out:
            self._device_call("_swap_out", list(device_ids), list(host_ids))
        for host_ids, device_ids in plan.swap_in:
            self._device_call("_swap_in", list(host_ids), list(device_ids))

    def run(self, prefills, decodes) -> "RunnerOutput":
        """The model over prefill chunks and decoding requests. Running a request again with the same
        inputs rewrites the same K/V and samples the same token (seeded draws), so the engine may rerun
        parts of a step to find the request that makes it fail."""
        out = RunnerOutput()
        scoring = [c for c in prefills if c.request.scores_prompt]
        plain = [c for c in prefills if not c.request.scores_prompt]
        for chunk in scoring:  # one per call: every row's logits are needed
            self._run_prefill([chunk], out, score=True)
        most = self.buckets.prefill_seqs[-1]
        if plain and len(plain) + len(decodes) <= most:  # one ragged call: the decodes ride along
            self._run_prefill(plain, out, score=False, decodes=decodes)
            return out
        for i in range(0, len(plain), most):  # (more sequences than running requests can be: not from the scheduler)
            self._run_prefill(plain[i:i + most], out, score=False)
        if decodes:
            self._run_decodes(decodes, out)
        else:
            self.decode_rows.sync([])  # the rows of requests that left the batch go (DecodeRows: every step)
        return out

    def advance(self) -> None:
        """The last step's tokens are in its requests (Scheduler.postprocess): the decode rows move on."""
        self.decode_rows.advance()

    def _run_decodes(self, decodes, out: "RunnerOutput") -> None:
        buf, layout, history, mode, plain = self._pack_decodes(decodes)
        self._decoded(decodes, self._call(buf, layout, history, mode=mode), plain, out)

    def _decoded(self, decodes, sample, plain: bool, out: "RunnerOutput") -> None:
        """The decode rows' tokens (the call's first rows) into the rows (DecodeRows.sampled) and `out`."""
        tokens = sample[0][:len(decodes)]
        rows = self.decode_rows
        rows.sampled(tokens)
        out.decoded = DecodeTokens(decodes, tokens.tolist(), rows.may_stop(tokens))
        if not plain:
            self._collect_logprobs(decodes, sample, out)

    def dispatch_decodes(self, decodes) -> DecodeFlight | None:
        """Async scheduling: start the decode batch's call and return at once, its tokens left on the device;
        the rows move on now (DecodeRows.dispatched), so the next call can be packed and dispatched before
        this one's tokens are fetched (`land`). The plan must be decodes only, with no swaps. None, with nothing
        started, when a row needs its last token on the host first (DecodeRows.can_run_ahead): run it instead."""
        buf, layout, history, mode, plain = self._pack_decodes(decodes)
        rows = self.decode_rows
        if not rows.can_run_ahead():
            return None
        t0 = time.perf_counter()
        (sample, _), mode = self._dispatch(buf, layout, history, None, mode)
        self.timings["pack_s"] += time.perf_counter() - t0
        packed = rows.packed_rows()
        return DecodeFlight(decodes, sample, mode, plain, packed, rows.dispatched())

    def land(self, flight: DecodeFlight) -> "RunnerOutput":
        """Fetch a dispatched decode call's tokens (waiting for it): the step's RunnerOutput."""
        t0 = time.perf_counter()
        sample = fetch_sample(flight.sample, flight.mode)
        self.timings["device_s"] += time.perf_counter() - t0
        decodes, rows = flight.requests, self.decode_rows
        tokens = sample[0][:len(decodes)]
        rows.landed(flight.packed, flight.generations, tokens)
        out = RunnerOutput(decoded=DecodeTokens(decodes, tokens.tolist(), rows.may_stop(tokens, flight.packed)))
        if not flight.plain:
            self._collect_logprobs(decodes, sample, out)
        return out

    def _pack_decodes(self, decodes):
        """The decode batch's buffer and layout, the (request, tokens) rows for the sampler, the sampler when
        known (else None: _call asks) and whether every row is plain argmax."""
        t0 = time.perf_counter()
        rows = self.decode_rows
        # The sampler decides the layout only while a cold lazy start is still compiling (layout_for); asked
        # then of every row, otherwise only of the rows not plain argmax, after the pack.
        mode = _sampler_mode([(r, r.num_tokens) for r in decodes]) if self._ready is not None else None
        layout = self.layout_for(decodes, decode=True, mode=mode or "greedy")
        buf = rows.pack(decodes, layout)
        self.timings["pack_s"] += time.perf_counter() - t0
        plain = rows.all_plain()  # then no row needs the full sampler's question, nor logprobs
        # (request, tokens it has after this step): num_tokens, from the packed positions; lazily (numpy
        # scalars, none made unless read) when the greedy sampler needs none of it
        lengths = rows.packed_positions() + 1
        history = zip(decodes, lengths) if plain else list(zip(decodes, lengths.tolist()))
        return buf, layout, history, mode or ("greedy" if plain else None), plain

    @property
    def cache_lost(self) -> bool:
        """True when a failed jitted call had already consumed the donated KV cache: nothing can go on."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(self.kv_cache))

    def _run_prefill(self, chunks, out: "RunnerOutput", score: bool, decodes=()):
        """Prefill chunks, and `decodes` (a ragged step's decoding requests, synchronous: each feeds its last
        token, which the host has) in the same call, as its first sequences."""
        t0 = time.perf_counter()
        seqs = [SeqSlice(c.request.all_token_ids[c.start:c.start + c.length], c.start, c.request.block_ids)
                for c in chunks]
        rows = [(r, r.num_tokens) for r in decodes] + [(c.request, c.start + c.length) for c in chunks]
        mode = _sampler_mode(rows)
        layout = self.layout_for(seqs, decode=False, mode=mode, all_logits=score, decodes=len(decodes))
        after = (self.decode_rows.pack(decodes, layout), len(decodes)) if decodes else None
        buf = pack(seqs, layout, self.block_size, all_logits=score, after=after)
        self.timings["pack_s"] += time.perf_counter() - t0
        if score:
            (chunk,) = chunks
            sample, scores = self._call(buf, layout, rows, score_chunk=chunk, mode=mode)
            out.prompt_logprobs[chunk.request.request_id] = (chunk.start + 1, scores)
        else:
            sample = self._call(buf, layout, rows, mode=mode)
        if decodes:
            self._decoded(decodes, sample, self.decode_rows.all_plain(), out)
        sampling = [(i, c) for i, c in enumerate(chunks, len(decodes)) if c.samples]
        self._collect([c.request for _, c in sampling], _select_rows(sample, [i for i, _ in sampling]), out)

    def _collect(self, requests, sample, out: "RunnerOutput"):
        out.tokens.update(zip([r.request_id for r in requests], sample[0].tolist()))
        self._collect_logprobs(requests, sample, out)

    @staticmethod
    def _collect_logprobs(requests, sample, out: "RunnerOutput"):
        _, logprob, top_ids, top_lp = sample
        for i, r in [(i, r) for i, r in enumerate(requests)
                     if r.plain_argmax is not True and r.params is not None and r.params.logprobs is not None]:
            k = r.params.logprobs
            out.logprobs[r.request_id] = (float(logprob[i]), list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())))

    def _sampling_row(self, request, history_len: int) -> SamplingRow:
        params = request.params or GREEDY
        # The token history only feeds the penalties: copying prompt + outputs for every row every step
        # would be O(context) host work that the greedy path throws away.
        if params.has_penalties:  # a mid-prompt chunk's history is part of the prompt (its draw is discarded)
            history = request.all_token_ids[:history_len]
            prompt_len = min(request.num_prompt_tokens, history_len)
        else:
            history, prompt_len = (), 0
        # A grammar's mask only for a row whose token is kept: one that reaches the end of the request's tokens
        # (a mid-prompt chunk's, or a recompute's re-prefill of its outputs, is discarded).
        samples = history_len == request.num_tokens
        allowed = request.grammar.allowed_mask() if request.grammar is not None and samples else None
        # The draw's index among the outputs from history_len, not the request's list: under async scheduling
        # a decode row runs one token ahead of its request's outputs (the same in a synchronous step).
        output_index = max(0, history_len - request.num_prompt_tokens)
        return SamplingRow(params, request.seed, output_index, history, prompt_len, request.banned_token_ids,
                           allowed)

    def layout_for(self, seqs, decode: bool, mode: str = "greedy", all_logits: bool = False,
                   decodes: int = 0) -> StepLayout:
        """The bucketed layout for `seqs` (SeqSlices; for a decode step anything with a length), with
        `decodes` one-token sequences before them in a prefill call, and the sampler `mode`. While a cold lazy
        warm-up is still compiling (`_ready` is not None), the smallest program already compiled that holds
        them, which may be a larger bucket than theirs: padding a step costs less than compiling its program
        (~1 s) in it."""
        b = self.buckets
        if decode:
            exact = b.decode_layout(b.pick(b.decode_batch, len(seqs)))
        else:
            num_seqs = b.prefill_seqs[0] if all_logits else b.pick(b.prefill_seqs, decodes + len(seqs))
            exact = b.prefill_layout(b.pick(b.prefill_tokens, decodes + sum(len(s.token_ids) for s in seqs)), num_seqs,
                                     all_logits)
        ready = self._ready
        if ready is not None and not all_logits:  # scored prompts' programs are never warmed: theirs
            larger = (b.decode_layouts(exact.num_seqs) if decode else
                      b.prefill_layouts(exact.num_tokens, exact.num_seqs))
            for layout in larger:
                if (layout, mode) in ready:
                    return layout
        return exact

    def _call(self, buf, layout: StepLayout, rows, score_chunk=None, mode: str | None = None):
        """Run the jitted step on a packed buffer, fetch its (small) outputs. `rows`: (request, tokens
        it has once this step is done) per sequence: a list, or with `mode` (the sampler, when the caller knows
        it) any iterable, read at most once. Returns numpy (tokens, logprob, top_ids, top_logprobs) per logits
        row, and with `score_chunk` also that chunk's prompt logprobs."""
        t0 = time.perf_counter()
        (sample, scores), mode = self._dispatch(buf, layout, rows, score_chunk, mode)
        t1 = time.perf_counter()
        sample = fetch_sample(sample, mode)
        self.timings["pack_s"] += t1 - t0
        self.timings["device_s"] += time.perf_counter() - t1
        if score_chunk is None:
            return sample
        return sample, self._prompt_scores(score_chunk, jax.device_get(scores))

    def _dispatch(self, buf, layout: StepLayout, rows, score_chunk, mode: str | None):
        """Start the jitted step (its sampling metadata built here): ((its on-device SampleOutput, prompt scores
        or None), the sampler mode)."""
        mode = mode or _sampler_mode(rows)
        sampling_md = (build_sampling_metadata([self._sampling_row(r, n) for r, n in rows], layout.num_seqs,
                                               layout.width * self.block_size, self.model.cfg.vocab_size)
                       if mode == "full" else None)
        scoring = None
        if score_chunk is not None:
            sample_rows = np.zeros(layout.num_seqs, np.int32)
            sample_rows[0] = score_chunk.length - 1
            scoring = (*self._next_prompt_ids(score_chunk, layout.num_tokens), sample_rows)
        return self._device_call("device_step", buf, sampling_md, layout, mode, scoring), mode

    def device_step(self, buf, sampling_md, layout: StepLayout, mode: str, scoring=None):
        """The one jitted call of a step, from host inputs only (so other processes can replay it):
        the packed buffer, the sampling metadata, and for a scored prompt (next_ids, num_top, sample_rows).
        Returns the on-device (SampleOutput, prompt scores or None)."""
        m = self.model
        with jax.set_mesh(self.mesh):
            if scoring is None:
                sample, fed, self.kv_cache = sample_step(self.graphdef, m.state, self.kv_cache,
                                                         self.fed if layout.decode else None, buf, sampling_md,
                                                         layout, mode, self.attention_impl)
                if layout.decode:
                    self.fed = fed
                return sample, None
            next_ids, num_top, sample_rows = scoring
            scores, sample, self.kv_cache = prompt_logprobs_step(
                self.graphdef, m.state, self.kv_cache, buf, sampling_md, next_ids, sample_rows, layout, mode,
                num_top, self.attention_impl)
            return sample, scores

    def _next_prompt_ids(self, chunk, num_rows):
        """The prompt token each row predicts (-1 past the prompt), and how many top logprobs to keep."""
        request = chunk.request
        next_ids = np.full(num_rows, -1, np.int32)
        following = request.prompt_token_ids[chunk.start + 1:chunk.start + chunk.length + 1]
        next_ids[:len(following)] = following
        return next_ids, max(1, bucket(request.params.prompt_logprobs or 1))

    @staticmethod
    def _prompt_scores(chunk, scores):
        """[(logprob of the next prompt token, [(id, logprob) of the top k]), ...] for the chunk's rows
        that predict a prompt token."""
        chosen, top_ids, top_values = scores
        request = chunk.request
        k = request.params.prompt_logprobs
        rows = min(chunk.length, request.num_prompt_tokens - 1 - chunk.start)
        return [(float(chosen[i]), list(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())))
                for i in range(max(rows, 0))]

    def _padded_ids(self, ids) -> np.ndarray:
        out = np.full(self.buckets.pick(self.buckets.swap_blocks, len(ids)), NULL_BLOCK, np.int32)
        out[:len(ids)] = ids
        return out

    def _swap_out(self, device_ids, host_ids):
        blocks = _gather_blocks(self.kv_cache, self._padded_ids(device_ids))
        if self.host_sharding is not None:
            blocks = jax.device_put(blocks, self.host_sharding)
        else:
            blocks = jax.tree.map(np.asarray, blocks)
        self.swapped[tuple(host_ids)] = blocks

    def _swap_in(self, host_ids, device_ids):
        blocks = self.swapped.pop(tuple(host_ids))
        blocks = jax.device_put(blocks, self.device_sharding)
        self.kv_cache = _scatter_blocks(self.kv_cache, self._padded_ids(device_ids), blocks, self._native_swap_in)

    def drop_swapped(self, host_ids):
        """A swapped request was aborted: forget its host copy."""
        self._device_call("_drop_swapped", list(host_ids))

    def _drop_swapped(self, host_ids):
        self.swapped.pop(tuple(host_ids), None)

    # -------------------------------------------------------------- warm-up

    def warmup(self, sampling: bool = True, background: bool = False) -> float:
        return self._device_call("_warmup", sampling, background)

    def _warmup(self, sampling: bool, background: bool) -> float:
        """Compile every step layout for the greedy sampler and, if `sampling`, for the full one too,
        and every swap size.

        With `background`, only the programs that can run any step compile before this returns: for each
        sampler, the largest decode batch and the largest prefill. Steps pad up to the smallest program
        compiled so far (layout_for), and the rest compile on a thread, smallest first (`wait_for_warmup`
        joins it), then the swap copies. When the persistent cache is known to hold them all
        (`_warm_record`), nothing compiles before this returns: loading a program costs its trace,
        ~0.1-0.3 s, so a warm start serves at once and a request that comes first loads its own program.

        Ahead of time (lower + compile: nothing runs and the cache is not touched), on one thread per
        core: tracing holds the GIL, XLA's compile does not. Returns the seconds it took."""
        t0 = time.perf_counter()
        layouts = self.buckets.step_layouts()
        modes = ("greedy", "full") if sampling else ("greedy",)
        groups = [[(layout, mode) for layout in layouts] for mode in modes]
        groups = [(programs, self._warm_record(programs)) for programs in groups]
        now, later, self._ready = groups, [], None
        if background:
            greedy_record = groups[0][1]
            if greedy_record is not None and greedy_record.exists():
                now, later = [], groups
            else:
                largest = {(max((layout for layout in layouts if layout.decode == decode),
                                key=lambda layout: (layout.num_tokens, layout.num_seqs)), mode)
                           for decode in (True, False) for mode in modes}
                now = [([p for programs, _ in groups for p in programs if p in largest], None)]
                later = [(sorted([p for p in programs if p not in largest], key=lambda p: p[0].num_tokens), record)
                         for programs, record in groups]
                self._ready = set(largest)
        # Shapes only: the background thread must not touch the cache, which steps donate meanwhile.
        cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.kv_cache)
        self._compile_steps(now, cache, threads=os.cpu_count() or 1, progress=True)
        if not background:
            self._warm_swaps()
        if later:
            self._background = threading.Thread(target=self._compile_in_background, args=(later, cache),
                                                name="ferry-warmup", daemon=True)
            self._stop_background.clear()
            # At exit, stop after the compile in progress: the interpreter must not finalize under it (an
            # abort), nor wait for every queued program (a SIGTERM'd server took a minute to exit).
            atexit.register(self.stop_background_warmup)
            self._background.start()
        self.timings = {"device_s": 0.0, "pack_s": 0.0}
        elapsed = time.perf_counter() - t0
        count = lambda gs: sum(len(programs) for programs, _ in gs)  # noqa: E731
        self.warmup_split = (count(now), count(later))
        log.info("warm-up: %d step programs%s in %.1f s%s", count(now),
                 "" if background else f" and {len(self.buckets.swap_blocks)} swap sizes", elapsed,
                 f"; {count(later)} programs and the swap copies compiling in the background" + (
                     "" if now else ", where an earlier start left them all in the persistent cache") if later else "")
        return elapsed

    def wait_for_warmup(self):
        """Join the background compilation `warmup(background=True)` started, if any."""
        if self._background is not None:
            self._background.join()
            self._background = None
            atexit.unregister(self.stop_background_warmup)

    def stop_background_warmup(self):
        """Let the background compilation finish the program in progress and stop; the rest compile on use."""
        self._stop_background.set()
        self.wait_for_warmup()

    def _warm_record(self, programs) -> pathlib.Path | None:
        """A file in JAX's persistent compilation cache that a finished compile of exactly `programs`
        (layout, sampler) leaves there, so the next start knows they load from it; None when the cache is
        off. A stale one (the cache emptied by hand) only costs compiles after serving starts. Its name
        hashes everything the compiled programs depend on: jax and jaxlib, Ferry's source, the model's
        config and parameter shapes, the cache's (block size included), the attention kernel, the
        devices, XLA_FLAGS."""
        records = warm_records_dir()
        if records is None:
            return None
        arrays = lambda tree: [(jax.tree_util.keystr(path), a.shape, str(a.dtype), str(a.sharding))  # noqa: E731
                               for path, a in jax.tree_util.tree_leaves_with_path(tree)]
        key = repr((jax.__version__, jaxlib.__version__, ferry_source_hash(), self.model.cfg, arrays(self.model.state),
                    arrays(self.kv_cache), programs, self.attention_impl,
                    [(d.platform, d.device_kind) for d in self.mesh.devices.flat], os.environ.get("XLA_FLAGS")))
        return records / hashlib.sha256(key.encode()).hexdigest()

    def _compile_steps(self, groups, cache, threads: int, progress: bool):
        """Compile sample_step for each (layout, sampler mode) of each group (programs, warm record or None)
        against `cache` (ShapeDtypeStructs), on `threads` threads; a group's record is left once it is done."""
        def compile_one(program):
            self.compile_step(*program, cache)
            if self._ready is not None:
                self._ready.add(program)

        for programs, record in groups:
            if threads == 1:  # the background warm-up: stops early when asked (stop_background_warmup)
                for i, program in enumerate(programs):
                    if self._stop_background.is_set():
                        log.info("warm-up: background compilation stopped, %d programs left to compile on first use",
                                 len(programs) - i)
                        return
                    compile_one(program)
            else:
                with (concurrent.futures.ThreadPoolExecutor(threads) as pool,
                      tqdm(total=len(programs), desc="warm-up", unit="program", disable=not progress) as bar):
                    for future in concurrent.futures.as_completed([pool.submit(compile_one, p) for p in programs]):
                        future.result()
                        bar.update(1)
            if record is not None:
                try:
                    record.parent.mkdir(parents=True, exist_ok=True)
                    record.touch()
                except OSError as e:  # a read-only cache: the next start just loads in the foreground
                    log.warning("warm-up: cannot leave a record in %s: %s", record.parent, e)

    def compile_step(self, layout: StepLayout, mode: str, cache=None):
        """sample_step compiled ahead of time for `layout` and sampler `mode`, against `cache` (default: the KV
        cache's shapes) and the arguments a step passes (shapes only: nothing runs). Under the mesh context the
        steps run in: it is part of what a compiled program is keyed by."""
        m = self.model
        cache = cache or jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                      self.kv_cache)
        fed = (jax.ShapeDtypeStruct(self.fed.shape, self.fed.dtype, sharding=self.fed.sharding) if layout.decode
               else None)
        buf = np.zeros(layout.size, np.int32)
        sampling_md = (build_sampling_metadata([], layout.num_seqs, layout.width * self.block_size,
                                               m.cfg.vocab_size) if mode == "full" else None)
        with jax.set_mesh(self.mesh):  # per thread: the mesh context is thread-local
            return sample_step.lower(self.graphdef, m.state, cache, fed, buf, sampling_md, layout, mode,
                                     self.attention_impl).compile()

    def _compile_in_background(self, groups, cache) -> None:
        t0 = time.perf_counter()
        self._compile_steps(groups, cache, threads=1, progress=False)
        if not self._stop_background.is_set():
            self._ready = None  # every step program is compiled: each step takes its own bucket again
            self._compile_swaps(cache)
            log.info("warm-up: the background thread compiled %d step programs and the swap copies in %.1f s",
                     sum(len(programs) for programs, _ in groups), time.perf_counter() - t0)

    def _compile_swaps(self, cache) -> None:
        """The swap copies of every size, ahead of time (_warm_swaps runs them instead: it must not run
        beside the steps, which donate the cache)."""
        for n in self.buckets.swap_blocks:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            blocks = tuple(jax.ShapeDtypeStruct((pages.shape[0], n, *pages.shape[2:]), pages.dtype,
                                                sharding=self.device_sharding) for pages in cache)
            # No mesh context, as _swap_out and _swap_in call them: it is part of what a program is keyed by.
            _gather_blocks.lower(cache, ids).compile()
            _scatter_blocks.lower(cache, ids, blocks, self._native_swap_in).compile()

    def _warm_swaps(self):
        for n in self.buckets.swap_blocks:
            host = tuple(range(-n, 0))  # placeholder ids that no real swap uses
            self._swap_out([NULL_BLOCK] * n, host)
            self._swap_in(host, [NULL_BLOCK] * n)


# ------------------------------------------------------------------ compile counting

class CompileCounter:
    """Counts XLA backend compilations through jax.monitoring (one event per compiled executable). A
    program loaded from the persistent compilation cache fires that event too; `cache_hits` counts those."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
    _registered = False
    count = 0
    cache_hits = 0

    @classmethod
    def install(cls):
        if not cls._registered:
            def listener(event, duration, **kwargs):
                if event == cls.EVENT:
                    cls.count += 1

            def hit_listener(event, **kwargs):
                if event == cls.CACHE_HIT_EVENT:
                    cls.cache_hits += 1
            jax.monitoring.register_event_duration_secs_listener(listener)
            jax.monitoring.register_event_listener(hit_listener)
            cls._registered = True
        return cls


@contextlib.contextmanager
def compile_guard(allowed: int = 0):
    """Raise if more than `allowed` compilations happen inside the block."""
    counter = CompileCounter.install()
    start = counter.count
    yield counter
    new = counter.count - start
    if new > allowed:
        raise RuntimeError(f"{new} new XLA compilation(s) after warm-up; a shape escaped the buckets")


def kv_bytes_per_block(cfg, block_size, dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_memory(cfg, block_size, dtype, memory_fraction: float, cap_blocks: int,
                          cpu_budget_bytes: int, devices=None) -> int:
    """KV blocks that fit in `memory_fraction` of an accelerator's free memory, or on CPU (or a
    device that reports no memory) in `cpu_budget_bytes`: a fixed budget, as vLLM's CPU backend, not a
    share of host RAM (half of it was gigabytes of zeros to allocate for a small model). At most
    `cap_blocks`: more than every sequence at full length could use is waste. Over `devices` (tensor
    parallel), each holds 1/len(devices) of every block, so an accelerator's budget is per device."""
    devices = devices or jax.devices()[:1]
    stats = (devices[0].memory_stats() or {}) if devices[0].platform != "cpu" else {}
    block_bytes = kv_bytes_per_block(cfg, block_size, dtype)
    if "bytes_limit" in stats:
        budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * memory_fraction)
        block_bytes //= len(devices)
    else:
        budget = cpu_budget_bytes
    return max(2, min(budget // block_bytes, cap_blocks))
