"""ModelRunner: runs the scheduler's steps on the device.

The scheduler decides; the runner does. Each step comes as plain data (a SchedulerOutput); the runner applies its
diffs to its own requests (`update_states`), copies swapped-out blocks to host memory and swapped-in ones back,
then runs the prefill chunks and the decode batch in one ragged call (a step that only decodes: a decode call), a
jitted call over bucketed shapes with the cache donated, and returns one sampled token per request that samples
(a ModelRunnerOutput). Under async scheduling a decode step is dispatched and left running; its output comes when
asked (AsyncModelRunnerOutput.get_output). Warm-up and the choice of compiled program live in its
CompilationManager (engine/worker/compilation.py), the KV cache and its swap space in its KVCacheStore
(engine/worker/kv_cache.py).
"""

import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.core.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from engine.worker.compilation import Buckets, CompilationManager
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.kv_cache import KVCacheStore
from engine.worker.packing import SeqSlice, StepLayout, bucket, pack
from engine.worker.sampler import build_sampling_metadata, fetch_sample, sampler_mode, sampling_row
from engine.worker.step import pooling_step, prompt_logprobs_step, sample_step
from models.loading import LoadedModel
from models.mesh import make_mesh
from models.paged import cache_page_dims, kv_cache_groups
from models.transformer import StaticGraphDef
from pallas_kernels.kernels import Kernels
from pallas_kernels.kv_quant import resolve_kv_dtype

log = logging.getLogger("ferry")


class DeviceStateLost(RuntimeError):
    """A step failed after the KV cache was donated to it (or a block copy failed): nothing can go on."""


class AsyncModelRunnerOutput:
    """A step's output that may still be on its way: `get_output()` waits for it (vLLM's AsyncModelRunnerOutput).
    `in_flight`: the step was dispatched and its tokens are on the device, where the next step's rows may read
    them. `deferred`: it could not start before the step in flight ahead of it lands, and runs when asked."""

    __slots__ = ("_output", "_fetch", "in_flight", "deferred")

    def __init__(self, output: ModelRunnerOutput | None = None, fetch=None, *, in_flight: bool = False,
                 deferred: bool = False):
        self._output, self._fetch, self.in_flight, self.deferred = output, fetch, in_flight, deferred

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output, self._fetch = self._fetch(), None
        return self._output


@dataclasses.dataclass(slots=True)
class DecodeFlight:
    """A decode call dispatched but not landed (async scheduling): what `ModelRunner._land` needs."""
    req_ids: list[str]       # the batch as scheduled (SchedulerOutput.decodes)
    sample: object           # its on-device SampleOutput
    mode: str                # the sampler it ran
    plain: bool              # every row plain argmax: no logprobs to collect
    packed: tuple            # InputBatch.packed_rows() of its pack
    generations: np.ndarray  # i64[n]: its rows' generations at dispatch (InputBatch.landed)


def _select_rows(sample, rows):
    return tuple(a[rows] for a in sample)


def _merge(out: ModelRunnerOutput, part: ModelRunnerOutput, decodes: list[str]) -> None:
    """Fold a run of part of a step (fault isolation) into `out`: its decode tokens too, by request id."""
    out.sampled.update(part.sampled)
    if part.decode_tokens is not None:
        out.sampled.update(zip(decodes, part.decode_tokens))
    out.logprobs.update(part.logprobs)
    out.prompt_logprobs.update(part.prompt_logprobs)
    out.pooler_output.update(part.pooler_output)


class ModelRunner:
    def __init__(self, model: LoadedModel, *, kernels: Kernels, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype=None,
                 mesh: jax.sharding.Mesh | None = None):
        """`model` is already placed on `mesh` (models.sharding.shard_model); None: one device, the default.
        `kernels`: what the steps run (Kernels.for_mesh)."""
        self.model, self.block_size, self.kernels = model, block_size, kernels
        self.graphdef = StaticGraphDef.of(model.graphdef)  # the jitted steps' static argument, hashed once
        self.mesh = mesh or make_mesh(jax.devices()[:1])
        self.buckets = Buckets.make(max_num_seqs, max_num_batched_tokens, math.ceil(max_model_len / block_size),
                                    kv_groups=kv_cache_groups(model.cfg).num_groups)
        kernels.check_step_limits(self.buckets.decode_batch[-1], self.buckets.width, self.buckets.prefill_tokens[-1])
        kv_dtype = jnp.dtype(model.dtype) if kv_dtype is None else resolve_kv_dtype(kv_dtype)  # "int8", "fp8" too
        self.kv = KVCacheStore(model.cfg, num_blocks, block_size, kv_dtype, self.mesh,
                               self.buckets.swap_blocks, native_write=kernels.native and self.mesh.size == 1,
                               page_dims=cache_page_dims(model.cfg, kernels, kv_dtype, self.mesh.size))
        self.requests: dict[str, CachedRequestState] = {}  # the worker's requests, by id
        self.input_batch = InputBatch(self.requests, max_num_seqs, self.buckets.width * self.buckets.kv_groups,
                                      block_size, max_model_len)
        # i32[largest decode batch]: the last decode call's tokens, left on the device (sample_step's `fed`)
        self.fed = jax.jit(lambda: jnp.zeros(self.buckets.decode_batch[-1], jnp.int32),
                           out_shardings=jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))()
        self.compilation = CompilationManager(self, self.buckets)
        self.timings = {"device_s": 0.0, "pack_s": 0.0}
        self._in_flight = 0  # decode calls dispatched and not landed
        # Multi-host (engine/worker/multihost.py): publish(op, args) tells the other processes to make the same
        # device call, `getattr(runner, op)(*args)`, so all enter the same programs in the same order.
        self.publish = None

    def _device_call(self, op: str, *args):
        if self.publish is not None:
            self.publish(op, args)
        return getattr(self, op)(*args)

    # -------------------------------------------------------------- the step

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> AsyncModelRunnerOutput:
        """Run one scheduled step: its diffs, its block copies (swap-outs first: those device blocks may be
        reused by swap-ins), then its prefill chunks and decode batch. `non_block` (async scheduling): a step that
        only decodes, whose rows need nothing from the host (InputBatch.can_run_ahead), is dispatched and left
        running, its tokens on the device for the next step's rows; a step that cannot start while one is in
        flight is deferred. Fault isolation: a request whose step fails (its inputs, its sampling) is found by
        running the step in parts and reported in `failed`; the rest of the batch goes on."""
        so = scheduler_output
        self.update_states(so)
        if non_block and so.decodes and so.decodes_only:
            try:
                flight = self._dispatch_decodes(so.decodes, so.grammar_bitmasks)
            except Exception as e:
                if self.kv.lost:
                    raise DeviceStateLost(f"an async decode step failed: {e!r}") from e
                log.warning("dispatching step %d failed (%r); running it synchronously", so.step, e)
                flight = None
            if flight is not None:
                return AsyncModelRunnerOutput(fetch=functools.partial(self._land, flight), in_flight=True)
            if self._in_flight:  # its rows feed on the step in flight: it runs once that one has landed
                return AsyncModelRunnerOutput(fetch=functools.partial(self._execute_now, so), deferred=True)
        return AsyncModelRunnerOutput(self._execute_now(so))

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diffs to the worker's requests and the decode batch (InputBatch.update); a
        finished (or swapped and now recomputed) request's host copy of its blocks goes too."""
        for req_id in scheduler_output.finished_req_ids + scheduler_output.preempted_req_ids:
            if req_id in self.kv.swapped:
                self._device_call("drop_swapped", req_id)
        self.input_batch.update(scheduler_output)

    def _execute_now(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The step, synchronously; then its tokens are its requests' (InputBatch.commit)."""
        try:
            for req_id, ids in so.swap_out:
                self._device_call("swap_out", req_id, list(ids))
            for req_id, ids in so.swap_in:
                self._device_call("swap_in", req_id, list(ids))
            out = self._run(so.prefills, so.decodes, so.grammar_bitmasks)
        except Exception as e:
            if self.kv.lost or not (so.prefills or so.decodes):
                raise DeviceStateLost(f"the step failed with the device state lost: {e!r}") from e
            log.warning("step %d failed (%r); isolating the requests that cause it", so.step, e)
            units = [([c], []) for c in so.prefills] + [([], [r]) for r in so.decodes]
            out = ModelRunnerOutput()
            self._run_isolating(units, e, out, so.grammar_bitmasks)
        self.input_batch.commit(so, out)
        return out

    def _run_isolating(self, units, error: Exception | None, out: ModelRunnerOutput, masks: dict) -> None:
        """Run `units` (([prefill chunk], [decode req id]) pairs) together, or in halves if that fails."""
        if error is None:
            decodes = [r for _, d in units for r in d]
            try:
                _merge(out, self._run([c for p, _ in units for c in p], decodes, masks), decodes)
                return
            except Exception as e:
                if self.kv.lost:
                    raise DeviceStateLost(f"the step failed with the device state lost: {e!r}") from e
                error = e
        if len(units) == 1:
            (prefill, decode), = units
            out.failed.setdefault(prefill[0].req_id if prefill else decode[0], error)
            return
        half = len(units) // 2
        self._run_isolating(units[:half], None, out, masks)
        self._run_isolating(units[half:], None, out, masks)

    def _run(self, prefills: list[ScheduledChunk], decodes: list[str], masks: dict) -> ModelRunnerOutput:
        """The model over prefill chunks and decoding requests. Running a request again with the same inputs
        rewrites the same K/V and samples the same token (seeded draws), so a step may be rerun in parts to find
        the request that makes it fail."""
        out = ModelRunnerOutput()
        requests = self.requests
        pooling = [c for c in prefills if requests[c.req_id].pools]
        if pooling:  # embeddings: their own calls, which sample nothing
            self._run_pooling(pooling, out)
            prefills = [c for c in prefills if not requests[c.req_id].pools]
        scoring = [c for c in prefills if requests[c.req_id].scores_prompt]
        plain = [c for c in prefills if not requests[c.req_id].scores_prompt]
        per_call = self.buckets.prefill_seqs[0]  # their calls' layout: every row's logits, the fewest sequences
        for i in range(0, len(scoring), per_call):
            self._run_prefill(scoring[i:i + per_call], out, masks, score=True)
        most = self.buckets.prefill_seqs[-1]
        if plain and len(plain) + len(decodes) <= most:  # one ragged call: the decodes ride along
            self._run_prefill(plain, out, masks, score=False, decodes=decodes)
            return out
        for i in range(0, len(plain), most):  # (more sequences than running requests can be: not from the scheduler)
            self._run_prefill(plain[i:i + most], out, masks, score=False)
        if decodes:
            self._run_decodes(decodes, out, masks)
        else:
            self.input_batch.sync([])  # the rows of requests that left the batch go (InputBatch: every step)
        return out

    def _run_decodes(self, decodes: list[str], out: ModelRunnerOutput, masks: dict) -> None:
        buf, layout, history, mode, plain = self._pack_decodes(decodes, masks)
        self._decoded(decodes, self._call(buf, layout, history, masks, mode=mode), plain, out)

    def _decoded(self, decodes: list[str], sample, plain: bool, out: ModelRunnerOutput) -> None:
        """The decode rows' tokens (the call's first rows) into the rows (InputBatch.sampled) and `out`."""
        tokens = sample[0][:len(decodes)]
        batch = self.input_batch
        batch.sampled(tokens)
        out.decode_tokens, out.may_stop = tokens.tolist(), batch.may_stop(tokens)
        if not plain:
            self._collect_logprobs(decodes, sample, out)

    def _dispatch_decodes(self, decodes: list[str], masks: dict) -> DecodeFlight | None:
        """Async scheduling: start the decode batch's call and return at once, its tokens left on the device;
        the rows move on now (InputBatch.dispatched), so the next call can be packed and dispatched before
        this one's tokens are fetched (`_land`). None, with nothing started, when a row needs its last token on
        the host first (InputBatch.can_run_ahead): run it instead."""
        buf, layout, history, mode, plain = self._pack_decodes(decodes, masks)
        batch = self.input_batch
        if not batch.can_run_ahead():
            return None
        t0 = time.perf_counter()
        (sample, _), mode = self._dispatch(buf, layout, history, masks, None, mode)
        self.timings["pack_s"] += time.perf_counter() - t0
        self._in_flight += 1
        return DecodeFlight(decodes, sample, mode, plain, batch.packed_rows(), batch.dispatched())

    def _land(self, flight: DecodeFlight) -> ModelRunnerOutput:
        """Fetch a dispatched decode call's tokens (waiting for it); they become its requests' (those still
        held: a request may have left meanwhile)."""
        t0 = time.perf_counter()
        sample = fetch_sample(flight.sample, flight.mode)
        self.timings["device_s"] += time.perf_counter() - t0
        self._in_flight -= 1
        batch = self.input_batch
        tokens = sample[0][:len(flight.req_ids)]
        batch.landed(flight.packed, flight.generations, tokens)
        out = ModelRunnerOutput(decode_tokens=tokens.tolist(), may_stop=batch.may_stop(tokens, flight.packed))
        if not flight.plain:
            self._collect_logprobs(flight.req_ids, sample, out)
        batch.append_outputs(flight.req_ids, out.decode_tokens)
        return out

    def _pack_decodes(self, decodes: list[str], masks: dict):
        """The decode batch's buffer and layout, the (state, tokens) rows for the sampler, the sampler when
        known (else None: _call asks) and whether every row is plain argmax."""
        t0 = time.perf_counter()
        batch, requests = self.input_batch, self.requests
        # The sampler decides the layout only while a cold lazy start is still compiling (layout_for); asked
        # then of every row, otherwise only of the rows not plain argmax, after the pack.
        mode = sampler_mode([(requests[r], 0) for r in decodes], masks) if self.compilation.warming else None
        layout = self.compilation.layout_for(decodes, decode=True, mode=mode or "greedy")
        buf = batch.pack(decodes, layout)
        self.timings["pack_s"] += time.perf_counter() - t0
        plain = batch.all_plain()  # then no row needs the full sampler's question, nor logprobs
        # (state, tokens it has after this step): from the packed positions; lazily (no state looked up, numpy
        # scalars, none made unless read) when the greedy sampler needs none of it
        lengths = batch.packed_positions() + 1
        states = map(requests.__getitem__, decodes)
        history = zip(states, lengths) if plain else list(zip(states, lengths.tolist()))
        return buf, layout, history, mode or ("greedy" if plain else None), plain

    def _run_prefill(self, chunks: list[ScheduledChunk], out: ModelRunnerOutput, masks: dict, score: bool,
                     decodes: list[str] = ()):
        """Prefill chunks, and `decodes` (a ragged step's decoding requests, synchronous: each feeds its last
        token, which the host has) in the same call, as its first sequences."""
        t0 = time.perf_counter()
        requests = self.requests
        states = [requests[c.req_id] for c in chunks]
        seqs = [SeqSlice(s.token_ids(c.start, c.start + c.length), c.start, s.block_ids) for s, c in zip(states,
                                                                                                         chunks)]
        rows = [(requests[r], requests[r].num_tokens) for r in decodes]
        rows += [(s, c.start + c.length) for s, c in zip(states, chunks)]
        mode = sampler_mode(rows, masks)
        layout = self.compilation.layout_for(seqs, decode=False, mode=mode, all_logits=score, decodes=len(decodes))
        after = (self.input_batch.pack(decodes, layout), len(decodes)) if decodes else None
        buf = pack(seqs, layout, self.block_size, all_logits=score, after=after)
        self.timings["pack_s"] += time.perf_counter() - t0
        if score:
            sample, scores = self._call(buf, layout, rows, masks, score_chunks=chunks, mode=mode)
            for chunk, chunk_scores in zip(chunks, scores):
                out.prompt_logprobs[chunk.req_id] = (chunk.start + 1, chunk_scores)
        else:
            sample = self._call(buf, layout, rows, masks, mode=mode)
        if decodes:
            self._decoded(decodes, sample, self.input_batch.all_plain(), out)
        sampling = [(i, c) for i, c in enumerate(chunks, len(decodes)) if c.samples]
        picked = _select_rows(sample, [i for i, _ in sampling])
        out.sampled.update(zip([c.req_id for _, c in sampling], picked[0].tolist()))
        self._collect_logprobs([c.req_id for _, c in sampling], picked, out)

    def _run_pooling(self, chunks: list[ScheduledChunk], out: ModelRunnerOutput) -> None:
        """Embeddings' prefill chunks, as many sequences a call as a prefill bucket holds: each chunk's sum of
        final hidden states, and the last prompt row of a chunk that ends its prompt, into `out.pooler_output`."""
        most = self.buckets.prefill_seqs[-1]
        for i in range(0, len(chunks), most):
            part = chunks[i:i + most]
            t0 = time.perf_counter()
            states = [self.requests[c.req_id] for c in part]
            seqs = [SeqSlice(s.token_ids(c.start, c.start + c.length), c.start, s.block_ids)
                    for s, c in zip(states, part)]
            layout = self.compilation.pooling_layout(seqs)
            buf = pack(seqs, layout, self.block_size)
            t1 = time.perf_counter()
            sums, last = jax.device_get(self._device_call("device_pool", buf, layout))
            self.timings["pack_s"] += t1 - t0
            self.timings["device_s"] += time.perf_counter() - t1
            for j, (state, chunk) in enumerate(zip(states, part)):
                ends = chunk.start + chunk.length == state.num_prompt_tokens
                out.pooler_output[chunk.req_id] = (sums[j], last[j] if ends else None)

    def _collect_logprobs(self, req_ids: list[str], sample, out: ModelRunnerOutput):
        _, logprob, top_ids, top_lp = sample
        requests = self.requests
        for i, req_id in enumerate(req_ids):
            state = requests.get(req_id)
            if state is None or state.plain_argmax or state.params is None or state.params.logprobs is None:
                continue
            k = state.params.logprobs
            out.logprobs[req_id] = (float(logprob[i]), list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())))

    def _call(self, buf, layout: StepLayout, rows, masks: dict, score_chunks=None, mode: str | None = None):
        """Run the jitted step on a packed buffer, fetch its (small) outputs. `rows`: (state, tokens it has once
        this step is done) per sequence: a list, or with `mode` (the sampler, when the caller knows it) any
        iterable, read at most once. Returns numpy (tokens, logprob, top_ids, top_logprobs) per logits row, and
        with `score_chunks` (the call's chunks, all scored) also each chunk's prompt logprobs."""
        t0 = time.perf_counter()
        (sample, scores), mode = self._dispatch(buf, layout, rows, masks, score_chunks, mode)
        t1 = time.perf_counter()
        sample = fetch_sample(sample, mode)
        self.timings["pack_s"] += t1 - t0
        self.timings["device_s"] += time.perf_counter() - t1
        if score_chunks is None:
            return sample
        return sample, self._prompt_scores(score_chunks, jax.device_get(scores))

    def _dispatch(self, buf, layout: StepLayout, rows, masks: dict, score_chunks, mode: str | None):
        """Start the jitted step (its sampling metadata built here): ((its on-device SampleOutput, prompt scores
        or None), the sampler mode)."""
        mode = mode or sampler_mode(rows, masks)
        sampling_md = (build_sampling_metadata([sampling_row(s, n, masks) for s, n in rows], layout.num_seqs,
                                               layout.width * self.block_size, self.model.cfg.vocab_size)
                       if mode == "full" else None)
        scoring = None
        if score_chunks is not None:
            ends = np.cumsum([c.length for c in score_chunks])
            sample_rows = np.zeros(layout.num_seqs, np.int32)
            sample_rows[:len(score_chunks)] = ends - 1  # each chunk's last row
            scoring = (*self._next_prompt_ids(score_chunks, layout.num_tokens), sample_rows)
        return self._device_call("device_step", buf, sampling_md, layout, mode, scoring), mode

    def device_step(self, buf, sampling_md, layout: StepLayout, mode: str, scoring=None):
        """The one jitted call of a step, from host inputs only (so other processes can replay it):
        the packed buffer, the sampling metadata, and for a scored prompt (next_ids, num_top, sample_rows).
        Returns the on-device (SampleOutput, prompt scores or None)."""
        m, kv = self.model, self.kv
        with jax.set_mesh(self.mesh):
            if scoring is None:
                sample, fed, kv.pages = sample_step(self.graphdef, m.state, kv.pages,
                                                    self.fed if layout.decode else None, buf, sampling_md,
                                                    layout, mode, self.kernels)
                if layout.decode:
                    self.fed = fed
                return sample, None
            next_ids, num_top, sample_rows = scoring
            scores, sample, kv.pages = prompt_logprobs_step(
                self.graphdef, m.state, kv.pages, buf, sampling_md, next_ids, sample_rows, layout, mode,
                num_top, self.kernels)
            return sample, scores

    def device_pool(self, buf, layout: StepLayout):
        """An embeddings' call (pooling_step), from host inputs only (so other processes can replay it): the
        on-device (per-sequence sums, last rows) of the final hidden states."""
        with jax.set_mesh(self.mesh):
            pooled, self.kv.pages = pooling_step(self.graphdef, self.model.state, self.kv.pages, buf, layout,
                                                 self.kernels)
        return pooled

    def _next_prompt_ids(self, chunks: list[ScheduledChunk], num_rows: int):
        """The prompt token each row of the packed chunks predicts (-1 past a prompt, and in the padding), and how
        many top logprobs to keep (the most any chunk's request asks for)."""
        next_ids = np.full(num_rows, -1, np.int32)
        row = 0
        for chunk in chunks:
            state = self.requests[chunk.req_id]
            following = state.prompt_token_ids[chunk.start + 1:chunk.start + chunk.length + 1]
            next_ids[row:row + len(following)] = following
            row += chunk.length
        return next_ids, max(bucket(self.requests[c.req_id].params.prompt_logprobs or 1) for c in chunks)

    def _prompt_scores(self, chunks: list[ScheduledChunk], scores) -> list[list]:
        """Per chunk, [(logprob of the next prompt token, [(id, logprob) of the top k]), ...] for its rows that
        predict a prompt token."""
        chosen, top_ids, top_values = scores
        per_chunk, row = [], 0
        for chunk in chunks:
            state = self.requests[chunk.req_id]
            k = state.params.prompt_logprobs
            rows = min(chunk.length, state.num_prompt_tokens - 1 - chunk.start)
            per_chunk.append([(float(chosen[i]), list(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())))
                              for i in range(row, row + max(rows, 0))])
            row += chunk.length
        return per_chunk

    # -------------------------------------------------------------- device calls other processes replay

    def swap_out(self, req_id: str, block_ids: list[int]) -> None:
        self.kv.swap_out(req_id, block_ids)

    def swap_in(self, req_id: str, block_ids: list[int]) -> None:
        self.kv.swap_in(req_id, block_ids)

    def drop_swapped(self, req_id: str) -> None:
        self.kv.drop(req_id)

    def warmup(self, sampling: bool = True, background: bool = False) -> float:
        """Compile every step shape now (CompilationManager.warmup); returns the seconds it took."""
        return self._device_call("_warmup", sampling, background)

    def _warmup(self, sampling: bool, background: bool) -> float:
        return self.compilation.warmup(sampling, background)

    def warmup_pooling(self) -> float:
        """Compile every embeddings' program now (CompilationManager.warmup_pooling); returns the seconds it took."""
        return self._device_call("_warmup_pooling")

    def _warmup_pooling(self) -> float:
        return self.compilation.warmup_pooling()
