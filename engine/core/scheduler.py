"""The continuous-batching scheduler: decides, each step, which requests prefill (in chunks) and decode,
which get device blocks, and which are preempted. Host-side only: `schedule()` hands the worker the step as plain
data (a SchedulerOutput, engine/core/scheduler_output.py) and `update_from_output()` folds the worker's sampled
tokens back into the requests.

One step is five phases, in order:
  reap     requests finished last step leave; their blocks go back to the pool (cached ones stay findable)
  budget   free blocks minus what running decoders are already promised (and the watermark)
  admit    continue chunked prefills, then swapped and waiting requests in (priority, arrival) order
  preempt  only if demand exceeds the free blocks: evict least important, latest arrival first
  decode   every running request past its prefill gets its slot and advances one token (and every prefill chunk
           its sliding-window blocks: KV cache groups, engine/core/kv_cache_manager.py)

Every block change goes through the KVCacheManager (self.kv): this module only decides who gets what.
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.core.invariants import check_scheduler
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int                     # device blocks, including the reserved null block 0
    block_size: int
    max_num_seqs: int                   # running requests (so also the decode batch) at most
    max_num_batched_tokens: int         # tokens per step: one per decode, the rest for prefill chunks
    max_model_len: int
    chunk_size: int | None = None       # prefill chunk cap; None = as much as the token budget allows
    watermark_blocks: int = 0           # kept free at admission as headroom for running decoders
    preemption_mode: str = "recompute"  # "swap" | "recompute"
    num_host_blocks: int = 0            # swap space
    trace_history: int = 1000           # step traces kept in Scheduler.step_traces
    enable_prefix_caching: bool = True  # reuse cached K/V of equal leading blocks (engine.core.kv_cache_manager)
    group_windows: tuple[int, ...] = (0,)  # each KV cache group's sliding window, 0: full (models/paged.KVCacheGroups)

    def __post_init__(self):
        positive = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2: block 0 is the reserved null block")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request must be able to decode every step.
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} < "
                             f"max_num_seqs={self.max_num_seqs}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.watermark_blocks < 0 or self.num_host_blocks < 0:
            raise ValueError("watermark_blocks and num_host_blocks must be >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")


@dataclass(slots=True)
class PrefillChunk:
    request: Request
    start: int     # == request.num_computed_tokens when planned: first token index of this chunk
    length: int
    # The chunk reaches the end of the prefill target -> the runner samples a token from its last row.
    # False for a recompute re-prefill: its next token is already known (its last output token); and for an
    # embedding's chunks, which pool their rows instead (its last chunk finishes it: update_from_output).
    samples: bool


@dataclass(slots=True)
class StepPlan:
    """The scheduler's own record of a step, over live requests: what update_from_output advances, and what the
    engine reads back of it. The worker sees its plain form, the step's SchedulerOutput."""
    step: int
    finished: list[Request] = field(default_factory=list)                   # reaped this step (freed)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)  # (victim, device blocks): copy FIRST
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)   # (request, device blocks): copy next
    preempted: list[Request] = field(default_factory=list)                  # recompute victims
    swapped: list[Request] = field(default_factory=list)                    # swap victims (copies in swap_out)
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # input all_token_ids[-1] at position num_tokens-1
    trace: list[tuple[str, dict]] = field(default_factory=list)
    # Set by update_from_output: the decodes that had finished before it (an abort; under async scheduling a stop
    # in the step before), which gained nothing
    stale: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)


@dataclass(slots=True)
class _Pending:
    """An over-committed admission: its blocks are allocated once _preempt has freed enough."""
    request: Request
    num_blocks: int
    chunk_length: int


@dataclass(slots=True)
class _StepState:
    """Scratch shared by the phases of one schedule() call."""
    plan: StepPlan
    # Running requests past their prefill, in running order: computed once in _budget (O(running)), then
    # kept current by admission (a swapped request resuming its decode) and eviction
    decoders: list[Request] = field(default_factory=list)
    prefilling: list[Request] = field(default_factory=list)   # the other running requests, as _budget found them
    slot_takers: list[Request] = field(default_factory=list)  # the decoders whose next position starts a block
    ahead: int = 0  # tokens each decoder has in flight, sampled but not yet folded in (async scheduling)
    blocks_left: int = 0
    tokens_left: int = 0
    admitted: list[Request] = field(default_factory=list)  # joined the running set this step
    pending: list[_Pending] = field(default_factory=list)
    host_blocks_to_free: list[int] = field(default_factory=list)
    filled: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # sliding blocks of this step's chunks

    def trace(self, phase: str, **info) -> None:
        self.plan.trace.append((phase, info))


def _order(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.num_host_blocks, config.block_size,
                                 config.enable_prefix_caching, config.group_windows)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request added and not yet aborted or reaped
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.num_swap_fallbacks = 0             # swap victims recomputed because the host pool was full
        self.step_traces: deque[list[tuple[str, dict]]] = deque(maxlen=config.trace_history)
        self._num_steps = 0
        self._next_arrival = 0
        # The running set as the last schedule() left it (a copy) and its decoders, when that plan ran no
        # prefill chunk: while the set stays the same, its decoders do too (only a chunk ends a prefill)
        self._steady: tuple[list[Request], list[Request]] | None = None
        self._num_unreaped = 0  # requests update_from_output finished since the last reap (still in `running`)
        # The last plan was made ahead (async scheduling): its finished requests may hold one more slot
        self._last_plan_ahead = False
        self._aborted: list[str] = []  # ids the worker may hold state of, aborted since the last schedule()
        self._scheduled: dict[int, StepPlan] = {}  # the steps scheduled and not yet updated, by step number
        self._with_grammar: set[Request] = set()   # tracked requests under a grammar (whose rows need masks)
        self._decode_ids: tuple[list[Request], list[str]] = ([], [])  # the last decode batch and its ids

    # -------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        c, rid, n = self.config, request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request {rid!r}: duplicate request id")
        if n == 0:
            raise ValueError(f"request {rid!r}: empty prompt")
        if request.max_tokens < 1 and request.pooling is None:  # an embedding generates nothing
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        if n > c.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens is longer than max_model_len={c.max_model_len}")
        need = self.kv.peak_blocks(min(n + request.max_tokens, c.max_model_len),
                                   c.chunk_size or c.max_num_batched_tokens)
        if need > self.kv.num_total:
            raise ValueError(
                f"request {rid!r} can never fit in the KV cache: {n} prompt + {request.max_tokens} max tokens "
                f"(capped at max_model_len={c.max_model_len}) need {need} blocks of {c.block_size} tokens, "
                f"but the cache has {self.kv.num_total} usable blocks")
        request.arrival = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)
        if request.grammar is not None:
            self._with_grammar.add(request)

    def abort(self, request_id: str, reason: str = "abort") -> Request | None:
        """Drop a request in any state, freeing its device and host blocks now. None if unknown or already
        finished (a finished request leaves through the next step's reap). A step already scheduled may still
        run it harmlessly: nothing reuses the blocks before the next schedule(), whose SchedulerOutput tells the
        worker to drop the request's state (and any host copy of its blocks)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        {RequestStatus.RUNNING: self.running, RequestStatus.SWAPPED: self.swapped,
         RequestStatus.WAITING: self.waiting}[request.status].remove(request)
        if request.status is not RequestStatus.WAITING:  # the worker holds its state, or a host copy
            self._aborted.append(request_id)
        self.kv.free(request)
        request.finish(reason)
        del self.requests[request_id]
        self._with_grammar.discard(request)
        return request

    def has_unfinished(self) -> bool:
        """Whether the next step has anything to do: a request in any queue (finished-but-unreaped ones count:
        the next schedule() reaps them) or an aborted one the worker has not been told of."""
        return bool(self.waiting or self.running or self.swapped or self._aborted)

    # -------------------------------------------------------------- one step

    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """The next step, for the worker. `ahead`: the last step's decode batch is still running, its tokens
        not yet folded in (async scheduling); only when can_schedule_ahead() said so, so that this step is that
        batch decoding on, each request one token further than its counters say."""
        self._num_steps += 1
        step = _StepState(StepPlan(step=self._num_steps), ahead=int(ahead))
        self._last_plan_ahead = ahead
        self._reap(step)
        budget = self._budget(step)
        self._admit(step, budget)
        self._preempt(step)
        self._drop_admitted(step)
        self._decode(step)
        self.step_traces.append(step.plan.trace)
        self._steady = None if step.plan.prefills else (list(self.running), step.decoders)
        self._scheduled[step.plan.step] = step.plan
        return self._output(step)

    def can_schedule_ahead(self) -> bool:
        """Whether the next plan may be made before the last one's decode tokens are folded in: it is then
        surely the same decode batch going on (less what finished). Nothing waits (or every seat is taken, by
        requests none of which finished) or is swapped out, the last plan ran no prefill chunk, the running set
        is the same and all of it decodes, and the free blocks cover one more slot (a block per KV cache group) for
        every running request: no admission, no chunk, no preemption to decide on counters one token behind."""
        steady, running = self._steady, self.running
        seats_full = len(running) >= self.config.max_num_seqs and not self._num_unreaped  # nothing to admit to
        return ((not self.waiting or seats_full) and not self.swapped and steady is not None
                and running == steady[0] and len(steady[1]) == len(running)
                and self.kv.num_free >= len(running) * self.kv.num_groups)

    def _reap(self, step: _StepState) -> None:
        """Requests finished by the last update_from_output leave; their blocks return before _budget counts."""
        free_before = self.kv.num_free
        finished_status = RequestStatus.FINISHED  # a local: an enum member's lookup is dear in a loop
        finished = [r for r in self.running if r.status is finished_status]
        if finished:
            self.running = [r for r in self.running if r.status is not finished_status]
        for request in finished:
            self.kv.free(request)
            del self.requests[request.request_id]
            self._with_grammar.discard(request)
        step.plan.finished = finished
        self._num_unreaped = 0
        step.trace("reap", finished=[r.request_id for r in finished], free_before=free_before,
                   freed_blocks=self.kv.num_free - free_before, free_after=self.kv.num_free)

    def _budget(self, step: _StepState) -> int:
        """Blocks admission may hand out: free now (reaped and evictable cached blocks included) minus running
        decoders' new slots and the watermark. Negative means the decoders alone are short."""
        free = self.kv.num_free
        steady = self._steady
        if steady is not None and self.running == steady[0]:  # an identity compare, in C
            step.decoders = list(steady[1])
        else:
            # Request.in_prefill, inlined in a comprehension (this runs over the whole batch every step): a
            # property call per request is most of the cost
            step.decoders = [r for r in self.running
                             if r.num_computed_tokens >= r.num_tokens - (1 if r.output_token_ids else 0)]
        if len(step.decoders) < len(self.running):
            decoding = set(step.decoders)
            step.prefilling = [r for r in self.running if r not in decoding]
        step.slot_takers = self.kv.decode_slot_takers(step.decoders, step.ahead)
        promised = len(step.slot_takers) * self.kv.num_groups
        # The watermark is headroom for running decoders; with none running it would only block a big prompt.
        watermark = self.config.watermark_blocks if self.running else 0
        budget = free - promised - watermark
        step.trace("budget", free=free, promised=promised, watermark=watermark, budget=budget)
        return budget

    def _admit(self, step: _StepState, budget: int) -> None:
        """Hand out tokens and blocks: ongoing chunked prefills, then swapped, then waiting requests in
        (priority, arrival) order, stopping at the first that doesn't fit so long requests aren't starved."""
        step.blocks_left = budget
        step.tokens_left = self.config.max_num_batched_tokens - len(step.decoders)
        continued = []
        for request in sorted(step.prefilling, key=_order):
            if step.tokens_left == 0:
                break
            chunk = self._next_chunk(request, step)
            step.plan.prefills.append(chunk)
            step.blocks_left -= self.kv.chunk_blocks(request, chunk.start + chunk.length)
            continued.append(request.request_id)
        stopped_at = None
        for request in self._admission_queue():
            if not self._try_admit(request, step):
                stopped_at = request.request_id
                break
        step.trace("admit", continued=continued, admitted=[r.request_id for r in step.admitted],
                   pending=[p.request.request_id for p in step.pending], stopped_at=stopped_at,
                   blocks_left=step.blocks_left, tokens_left=step.tokens_left)

    def _preempt(self, step: _StepState) -> None:
        """Evict only when demand (new decode slots + over-committed admissions) exceeds the free blocks;
        then give the pending admissions their blocks."""
        demand_before = self._block_demand(step)
        victims = []
        while self.kv.num_free < self._block_demand(step):
            victim = self._pick_victim(step)
            if victim is None:  # admission only over-commits what evicting can cover
                raise RuntimeError(f"scheduler bug: {self.kv.num_free} free blocks, demand "
                                   f"{self._block_demand(step)}, and no request left to preempt")
            victims.append((victim.request_id, self._evict(victim, step)))
        for pending in step.pending:
            self._start(pending.request, pending.chunk_length, step)
        # Swapped-in requests' host blocks are released only now: the runner copies swap-outs first, so a
        # victim must never be given a host block that a swap-in of this same step still has to read.
        self.kv.release_host_blocks(step.host_blocks_to_free)
        step.trace("preempt", victims=victims, demand=demand_before, free=self.kv.num_free)

    def _drop_admitted(self, step: _StepState) -> None:
        """The requests admitted this step leave the waiting and swapped queues."""
        if step.admitted:
            self.waiting = [r for r in self.waiting if r.status is RequestStatus.WAITING]
            self.swapped = [r for r in self.swapped if r.status is RequestStatus.SWAPPED]

    def _decode(self, step: _StepState) -> None:
        """Every running request past its prefill gets the slot for position num_tokens-1 and decodes; every
        prefill chunk gets its sliding-group blocks (KVCacheManager.allocate_chunk)."""
        for chunk in step.plan.prefills if self.kv.sliding_groups else ():
            fills = self.kv.allocate_chunk(chunk.request, chunk.start + chunk.length)
            if fills is None:
                raise RuntimeError(f"scheduler bug: {self.kv.num_free} free blocks for the chunk of "
                                   f"{chunk.request.request_id!r}")
            if fills:
                step.filled[chunk.request.request_id] = fills
        if not self.kv.allocate_decode_slots(step.slot_takers):
            raise RuntimeError(f"scheduler bug: {self.kv.num_free} free blocks for {len(step.slot_takers)} "
                               f"decode slots")
        new_blocks = len(step.slot_takers) * self.kv.num_groups
        step.plan.decodes = step.decoders
        step.trace("decode", decodes=[r.request_id for r in step.plan.decodes], new_blocks=new_blocks,
                   free=self.kv.num_free)

    # -------------------------------------------------------------- results

    def update_from_output(self, output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[StepPlan, list[Request]]:
        """Advance every request of a scheduled step by what the worker sampled for it. Returns the step's plan
        and the requests finished now, whose blocks stay until the next step's _reap (which counts them in that
        step's budget). Requests that finished meanwhile (an abort, a failed request) are left as they are."""
        plan = self._scheduled.pop(output.step)
        finished = []
        sampled = runner_output.sampled
        for chunk in plan.prefills:
            request = chunk.request
            if request.is_finished:  # aborted after schedule()
                continue
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(f"request {request.request_id!r}: chunk starts at {chunk.start} but "
                                   f"{request.num_computed_tokens} tokens are computed (step applied twice?)")
            request.num_computed_tokens += chunk.length
            self.kv.publish_computed(request)  # its K/V are written now: later admissions may share them
            self.kv.free_behind_window(request)
            if chunk.samples and request.append_output(sampled[request.request_id], self.config.max_model_len):
                finished.append(request)
            elif request.pooling is not None and not request.in_prefill:  # an embedding: done with its prompt
                request.finish("stop")
                finished.append(request)
        decodes = plan.decodes
        if runner_output.decode_tokens is not None:
            tokens, may_stop = runner_output.decode_tokens, np.flatnonzero(runner_output.may_stop).tolist()
        else:
            tokens = [None if r.status is RequestStatus.FINISHED else sampled[r.request_id] for r in decodes]
            may_stop = range(len(decodes))
        # The whole batch, every step: locals, no calls but the list's append. Request.append_output in two
        # halves: the append here for every row, the stop check below only where the token may stop.
        publish, block_size, finished_status = self.kv.publish_computed, self.config.block_size, RequestStatus.FINISHED
        behind_window = self.kv.free_behind_window if self.kv.sliding_groups else None
        for request, token in zip(decodes, tokens):
            if request.status is finished_status:  # finished after schedule()
                plan.stale.append(request)
                continue
            n = request.num_tokens
            if request.num_computed_tokens + 1 != n:
                raise RuntimeError(f"request {request.request_id!r}: decoding with {request.num_computed_tokens}"
                                   f" of {n} tokens computed (step applied twice?)")
            request.num_computed_tokens = n
            if n % block_size == 0:  # one more token fills a block at most here
                publish(request)
            if behind_window is not None:
                behind_window(request)
            request.output_token_ids.append(token)
            request.num_tokens = n + 1
        max_model_len = self.config.max_model_len
        for i in may_stop:
            request = decodes[i]
            if request.status is not finished_status and request.stop_after_append(tokens[i], max_model_len):
                finished.append(request)
        self._num_unreaped += len(finished)
        return plan, finished

    def _output(self, step: _StepState) -> SchedulerOutput:
        """The step as the worker sees it: requests it has not seen (or must see anew) in full, for the others
        their new blocks, the ids that left, the block copies and the work, by request id."""
        plan, admitted, groups = step.plan, step.admitted, self.kv.num_groups
        new_ids = {r.request_id for r in admitted}
        if plan.decodes != self._decode_ids[0]:  # an identity compare, in C: a steady batch keeps its id list
            self._decode_ids = (plan.decodes, [r.request_id for r in plan.decodes])
        masks = {}
        if self._with_grammar:
            sampling = [c.request for c in plan.prefills if c.samples] + plan.decodes
            masks = {r.request_id: r.grammar.allowed_mask() for r in sampling if r in self._with_grammar}
        return SchedulerOutput(
            step=plan.step,
            new_requests=[NewRequestData.of(r) for r in admitted if r.status is RequestStatus.RUNNING],
            new_block_ids={r.request_id: r.block_ids[-groups:]
                           for r in step.slot_takers if r.request_id not in new_ids},
            filled_block_ids={rid: fills for rid, fills in step.filled.items() if rid not in new_ids},
            finished_req_ids=self._take_aborted() + [r.request_id for r in plan.finished],
            preempted_req_ids=[r.request_id for r in plan.preempted + plan.swapped],
            swap_out=[(r.request_id, ids) for r, ids in plan.swap_out],
            swap_in=[(r.request_id, ids) for r, ids in plan.swap_in],
            prefills=[ScheduledChunk(c.request.request_id, c.start, c.length, c.samples) for c in plan.prefills],
            decodes=self._decode_ids[1],
            grammar_bitmasks=masks,
            trace=plan.trace)

    def scheduled(self, step: int) -> StepPlan:
        """The scheduler's own record of a step scheduled and not yet updated (for observers and tests)."""
        return self._scheduled[step]

    def _take_aborted(self) -> list[str]:
        aborted, self._aborted = self._aborted, []
        return aborted

    # -------------------------------------------------------------- admission helpers

    def _admission_queue(self) -> list[Request]:
        # Within a priority level swapped requests go first (and, not fitting, block waiting ones);
        # a strictly more important waiting request is not held up by a less important swapped one.
        return sorted(self.swapped + self.waiting,
                      key=lambda r: (r.priority, r.status is not RequestStatus.SWAPPED, r.arrival))

    def _try_admit(self, request: Request, step: _StepState) -> bool:
        """Admit `request` if its blocks fit (the whole prefill target upfront, so a started prefill never
        waits for blocks; cache hits cost nothing unless they sit in the free list), or if evicting less
        important requests can make them fit (then it is pending until _preempt has)."""
        if len(self.running) + len(step.pending) >= self.config.max_num_seqs or step.tokens_left == 0:
            return False
        hits = self.kv.cached_prefix(request)
        waiting = request.status is RequestStatus.WAITING
        start = self.kv.hit_tokens(hits) if waiting else request.num_computed_tokens
        chunk_length = self._chunk_length(request, step.tokens_left, start) if request.in_prefill else 0
        need = self.kv.admission_cost(request, hits, start + chunk_length)
        fits = need <= step.blocks_left
        if not fits and need > step.blocks_left + self._reclaimable_blocks(request, step, hits):
            return False
        step.blocks_left -= need
        if waiting:
            # Held from now on: no allocation of this step can evict them before _start.
            self.kv.take_prefix(request, hits)
        step.tokens_left -= chunk_length if request.in_prefill else 1
        if fits:
            self._start(request, chunk_length, step)
        else:
            step.pending.append(_Pending(request, self.kv.admission_cost(request, [], start + chunk_length),
                                         chunk_length))
        return True

    def _reclaimable_blocks(self, request: Request, step: _StepState, hits: list[int]) -> int:
        """Over-commit: blocks that evicting the requests less important than `request` surely frees: running ones
        and swapped ones' kept heads (_pick_victim; requests admitted this step are never evicted). Only blocks a
        victim holds alone count, and not `request`'s own cache hits: a shared block outlives its victim."""
        victims = [r for r in self.running + self.swapped
                   if r.priority > request.priority and r not in step.admitted and r.block_ids]
        return self.kv.num_held_alone(victims, exclude=hits)

    def _start(self, request: Request, chunk_length: int, step: _StepState) -> None:
        """Give an admitted request its device blocks and put it in the running set."""
        if request.status is RequestStatus.SWAPPED:
            swap = self.kv.swap_in(request)
            if swap is None:
                raise RuntimeError(f"scheduler bug: no device blocks to swap {request.request_id!r} in")
            if swap[0]:  # a request whose blocks are all shared kept them on the device: nothing to copy
                step.plan.swap_in.append((request, swap[1]))
                step.host_blocks_to_free.extend(swap[0])
        elif self.kv.allocate_prefill(request) is None:
            raise RuntimeError(f"scheduler bug: no device blocks to admit {request.request_id!r}")
        # It leaves the waiting or swapped queue at the end of the step (_drop_admitted): one pass, not a
        # list.remove per admission (O(admitted x queue)).
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.admitted.append(request)
        if request.in_prefill:
            step.plan.prefills.append(self._chunk(request, chunk_length))
        else:  # a swapped-in request resumes decoding
            step.decoders.append(request)
            if self.kv.needs_decode_slot(request):
                step.slot_takers.append(request)

    def _chunk_length(self, request: Request, tokens_left: int, start: int | None = None) -> int:
        """The next chunk of the request's prefill, from `start` (default: its computed tokens)."""
        chunk_size = self.config.chunk_size or tokens_left
        start = request.num_computed_tokens if start is None else start
        return min(request.prefill_target - start, chunk_size, tokens_left)

    def _chunk(self, request: Request, length: int) -> PrefillChunk:
        start = request.num_computed_tokens
        samples = start + length == request.prefill_target and not request.output_token_ids and request.pooling is None
        return PrefillChunk(request, start, length, samples)

    def _next_chunk(self, request: Request, step: _StepState) -> PrefillChunk:
        length = self._chunk_length(request, step.tokens_left)
        step.tokens_left -= length
        return self._chunk(request, length)

    # -------------------------------------------------------------- preemption helpers

    def _block_demand(self, step: _StepState) -> int:
        """Blocks this step still takes: decode slots, pending admissions, and its chunks' sliding blocks."""
        demand = len(step.slot_takers) * self.kv.num_groups + sum(p.num_blocks for p in step.pending)
        if self.kv.sliding_groups:
            demand += sum(self.kv.chunk_blocks(c.request, c.start + c.length) for c in step.plan.prefills)
        return demand

    def _pick_victim(self, step: _StepState) -> Request | None:
        """Least important, then latest arrival; never one admitted this step, and never one at least as
        important as a pending admission (which is what admission counted on). A swapped request that kept its
        shared head on the device (KVCacheManager.swap_out) is one too, evicted to recompute: swapped requests
        sharing a head would otherwise pin it while a more important request evicts itself, step after step,
        for want of those blocks."""
        floor = max((p.request.priority for p in step.pending), default=None)
        pinning = [r for r in self.swapped if r.block_ids]
        candidates = [r for r in self.running + pinning
                      if r not in step.admitted and (floor is None or r.priority > floor)]
        return max(candidates, key=_order, default=None)

    def _evict(self, victim: Request, step: _StepState) -> str:
        victim.num_preemptions += 1
        if victim.status is RequestStatus.SWAPPED:  # its host copy goes too: it re-prefills later
            self.swapped.remove(victim)
            self._recompute(victim, step)
            self.num_preemptions["recompute"] += 1
            return "recompute"
        self.running.remove(victim)
        for chosen in (step.decoders, step.slot_takers):
            if victim in chosen:
                chosen.remove(victim)
        step.plan.prefills = [c for c in step.plan.prefills if c.request is not victim]  # its chunk is off
        if self.config.preemption_mode == "swap" and self._swap_out(victim, step):
            mode = "swap"
        else:
            mode = "recompute"
            self.num_swap_fallbacks += self.config.preemption_mode == "swap"
            self._recompute(victim, step)
        self.num_preemptions[mode] += 1
        return mode

    def _swap_out(self, victim: Request, step: _StepState) -> bool:
        """Move the victim's K/V to host blocks (those it shares stay: KVCacheManager.swap_out); False
        (nothing changed) if the host pool is too full."""
        swap = self.kv.swap_out(victim)
        if swap is None:
            return False
        if swap[0]:
            step.plan.swap_out.append((victim, swap[0]))
        victim.status = RequestStatus.SWAPPED
        self.swapped.append(victim)
        step.plan.swapped.append(victim)
        return True

    def _recompute(self, victim: Request, step: _StepState) -> None:
        """Drop the victim's K/V (its cached blocks stay in the cache, so its re-prefill may hit them); it
        re-queues with its outputs and re-prefills them later."""
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.append(victim)
        step.plan.preempted.append(victim)

    # -------------------------------------------------------------- observability

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # Read-only views for observers (server, serve CLI, tests); every change goes through self.kv.
    @property
    def block_pool(self):
        return self.kv.device_pool

    @property
    def host_pool(self):
        return self.kv.host_pool

    @property
    def kv_usage(self) -> float:
        return self.kv.device_pool.usage

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while any cached block is held."""
        return self.kv.reset_prefix_cache()

    def stats(self) -> dict:
        """Queue sizes, preemptions, KV usage and the prefix cache's counters (KVCacheManager.stats)."""
        return {"step": self._num_steps, "num_running": self.num_running, "num_waiting": self.num_waiting,
                "num_swapped": self.num_swapped, "preemptions": dict(self.num_preemptions),
                "swap_fallbacks": self.num_swap_fallbacks} | self.kv.stats()

    def check_invariants(self) -> None:
        """Raise AssertionError unless pools, queues and requests agree (engine/core/invariants.py): between steps,
        e.g. after every step in tests."""
        check_scheduler(self)
