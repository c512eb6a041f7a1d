"""The continuous-batching scheduler: decides, each step, which requests prefill (in chunks) and decode,
which get device blocks, and which are preempted. Host-side only; the runner executes its StepPlan.

One step is five phases, in order:
  reap     requests finished last step leave; their blocks go back to the pool (cached ones stay findable)
  budget   free blocks minus what running decoders are already promised (and the watermark)
  admit    continue chunked prefills, then swapped and waiting requests in (priority, arrival) order
  preempt  only if demand exceeds the free blocks: evict least important, latest arrival first
  decode   every running request past its prefill gets its slot and advances one token

Every block change goes through the KVCacheManager (self.kv): this module only decides who gets what.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus

PREEMPTION_MODES = ("swap", "recompute")


def _check(condition: bool, message: str) -> None:
    # Explicit raise rather than `assert`: invariant checks must survive `python -O`.
    if not condition:
        raise AssertionError(message)


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
    enable_prefix_caching: bool = True  # reuse cached K/V of equal leading blocks (engine.kv_cache_manager)

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
    # False for a recompute re-prefill: its next token is already known (its last output token).
    samples: bool


@dataclass(slots=True)
class StepPlan:
    step: int
    finished: list[Request] = field(default_factory=list)                     # reaped this step (freed)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (device, host): copy FIRST
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)   # (host, device): copy next
    preempted: list[Request] = field(default_factory=list)                    # recompute victims
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)  # input all_token_ids[-1] at position num_tokens-1
    trace: list[tuple[str, dict]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)


@dataclass(slots=True)
class DecodeTokens:
    """A decode batch's sampled tokens as the runner hands them over in one piece (postprocess's fast path)."""
    requests: list[Request]   # the batch as planned (StepPlan.decodes, the same list)
    tokens: list[int]         # [len(requests)] the token each sampled
    # bool[len(requests)]: where Request.check_stop may end the request (packing.DecodeRows.may_stop); the
    # other rows surely go on, so postprocess skips their check
    may_stop: np.ndarray


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
    ahead: int = 0  # tokens each decoder has in flight, sampled but not yet postprocessed (async scheduling)
    blocks_left: int = 0
    tokens_left: int = 0
    admitted: list[Request] = field(default_factory=list)  # joined the running set this step
    pending: list[_Pending] = field(default_factory=list)
    host_blocks_to_free: list[int] = field(default_factory=list)

    def trace(self, phase: str, **info) -> None:
        self.plan.trace.append((phase, info))


def _order(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.num_host_blocks, config.block_size,
                                 config.enable_prefix_caching)
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
        self._num_unreaped = 0  # requests postprocess finished since the last reap (still in `running`)
        # The last plan was made ahead (async scheduling): its finished requests may hold one more slot
        self._last_plan_ahead = False

    # -------------------------------------------------------------- requests in and out

    def add(self, request: Request) -> None:
        c, rid, n = self.config, request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request {rid!r}: duplicate request id")
        if n == 0:
            raise ValueError(f"request {rid!r}: empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        if n > c.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens is longer than max_model_len={c.max_model_len}")
        need = cdiv(min(n + request.max_tokens, c.max_model_len), c.block_size)
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

    def abort(self, request_id: str, reason: str = "abort") -> Request | None:
        """Drop a request in any state, freeing its device and host blocks now. None if unknown or already
        finished (a finished request leaves through the next step's reap). The request keeps its (now freed)
        block_ids / host_block_ids: a plan already handed out may still run it harmlessly (nothing reuses
        the blocks before the next schedule()), and the engine drops the runner's copies of its host blocks."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        {RequestStatus.RUNNING: self.running, RequestStatus.SWAPPED: self.swapped,
         RequestStatus.WAITING: self.waiting}[request.status].remove(request)
        self.kv.free(request, forget=False)
        request.finish(reason)
        del self.requests[request_id]
        return request

    def has_unfinished(self) -> bool:
        # Finished-but-unreaped requests count: the next schedule() reports them in plan.finished.
        return bool(self.waiting or self.running or self.swapped)

    # -------------------------------------------------------------- one step

    def schedule(self, ahead: bool = False) -> StepPlan:
        """The next step's plan. `ahead`: the last plan's decode batch is still running, its tokens not yet
        postprocessed (async scheduling); only when can_schedule_ahead() said so, so that this plan is that
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
        return step.plan

    def can_schedule_ahead(self) -> bool:
        """Whether the next plan may be made before the last one's decode tokens are postprocessed: it is then
        surely the same decode batch going on (less what finished). Nothing waits (or every seat is taken, by
        requests none of which finished) or is swapped out, the last plan ran no prefill chunk, the running set
        is the same and all of it decodes, and the free blocks cover one more for every running request: no
        admission, no chunk, no preemption to decide on counters one token behind."""
        steady, running = self._steady, self.running
        seats_full = len(running) >= self.config.max_num_seqs and not self._num_unreaped  # nothing to admit to
        return ((not self.waiting or seats_full) and not self.swapped and steady is not None
                and running == steady[0] and len(steady[1]) == len(running) and self.kv.num_free >= len(running))

    def _reap(self, step: _StepState) -> None:
        """Requests finished by the last postprocess leave; their blocks return before _budget counts."""
        free_before = self.kv.num_free
        finished_status = RequestStatus.FINISHED  # a local: an enum member's lookup costs 0.2 us in a loop (3.11)
        finished = [r for r in self.running if r.status is finished_status]
        if finished:
            self.running = [r for r in self.running if r.status is not finished_status]
        for request in finished:
            self.kv.free(request)
            del self.requests[request.request_id]
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
        promised = len(step.slot_takers)
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
            step.plan.prefills.append(self._next_chunk(request, step))
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
        """Every running request past its prefill gets the slot for position num_tokens-1 and decodes."""
        if not self.kv.allocate_decode_slots(step.slot_takers):
            raise RuntimeError(f"scheduler bug: {self.kv.num_free} free blocks for {len(step.slot_takers)} decode slots")
        new_blocks = len(step.slot_takers)
        step.plan.decodes = step.decoders
        step.trace("decode", decodes=[r.request_id for r in step.plan.decodes], new_blocks=new_blocks,
                   free=self.kv.num_free)

    # -------------------------------------------------------------- results

    def postprocess(self, plan: StepPlan, sampled: dict[str, int],
                    decoded: DecodeTokens | None = None) -> list[Request]:
        """Advance every planned request by what the runner computed: `sampled` (request id -> token), or
        for the decode batch `decoded` when given. Returns the requests finished now. Their blocks stay until
        the next step's _reap, which counts them in that step's budget."""
        finished = []
        for chunk in plan.prefills:
            request = chunk.request
            if request.is_finished:  # aborted after schedule()
                continue
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(f"request {request.request_id!r}: chunk starts at {chunk.start} but "
                                   f"{request.num_computed_tokens} tokens are computed (plan applied twice?)")
            request.num_computed_tokens += chunk.length
            self.kv.publish_computed(request)  # its K/V are written now: later admissions may share them
            if chunk.samples and request.append_output(sampled[request.request_id], self.config.max_model_len):
                finished.append(request)
        decodes = plan.decodes
        if decoded is not None and decoded.requests is decodes:
            tokens, may_stop = decoded.tokens, np.flatnonzero(decoded.may_stop).tolist()
        else:
            tokens = [None if r.status is RequestStatus.FINISHED else sampled[r.request_id] for r in decodes]
            may_stop = range(len(decodes))
        # The whole batch, every step: locals, no calls but the list's append. Request.append_output in two
        # halves: the append here for every row, the stop check below only where the token may stop.
        publish, block_size, finished_status = self.kv.publish_computed, self.config.block_size, RequestStatus.FINISHED
        for request, token in zip(decodes, tokens):
            if request.status is finished_status:  # aborted after schedule()
                continue
            n = request.num_tokens
            if request.num_computed_tokens + 1 != n:
                raise RuntimeError(f"request {request.request_id!r}: decoding with {request.num_computed_tokens}"
                                   f" of {n} tokens computed (plan applied twice?)")
            request.num_computed_tokens = n
            if n % block_size == 0:  # one more token fills a block at most here
                publish(request)
            request.output_token_ids.append(token)
            request.num_tokens = n + 1
        max_model_len = self.config.max_model_len
        for i in may_stop:
            request = decodes[i]
            if request.status is not finished_status and request.stop_after_append(tokens[i], max_model_len):
                finished.append(request)
        self._num_unreaped += len(finished)
        return finished

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
        need = self.kv.admission_cost(request, hits)
        fits = need <= step.blocks_left
        if not fits and need > step.blocks_left + self._reclaimable_blocks(request, step, hits):
            return False
        step.blocks_left -= need
        if request.status is RequestStatus.WAITING:
            # Held from now on: no allocation of this step can evict them before _start.
            self.kv.take_prefix(request, hits)
        chunk_length = self._chunk_length(request, step.tokens_left) if request.in_prefill else 0
        step.tokens_left -= chunk_length if request.in_prefill else 1
        if fits:
            self._start(request, chunk_length, step)
        else:
            step.pending.append(_Pending(request, self.kv.admission_cost(request, []), chunk_length))
        return True

    def _reclaimable_blocks(self, request: Request, step: _StepState, hits: list[int]) -> int:
        """Over-commit: blocks that evicting the running requests less important than `request` surely
        frees (requests admitted this step are never evicted). Only blocks a victim holds alone count, and
        not `request`'s own cache hits: a shared block outlives its victim."""
        victims = [r for r in self.running if r.priority > request.priority and r not in step.admitted]
        return self.kv.num_held_alone(victims, exclude=hits)

    def _start(self, request: Request, chunk_length: int, step: _StepState) -> None:
        """Give an admitted request its device blocks and put it in the running set."""
        if request.status is RequestStatus.SWAPPED:
            swap = self.kv.swap_in(request)
            if swap is None:
                raise RuntimeError(f"scheduler bug: no device blocks to swap {request.request_id!r} in")
            if swap[0]:  # a request whose blocks are all shared kept them on the device: nothing to copy
                step.plan.swap_in.append(swap)
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

    def _chunk_length(self, request: Request, tokens_left: int) -> int:
        chunk_size = self.config.chunk_size or tokens_left
        return min(request.prefill_target - request.num_computed_tokens, chunk_size, tokens_left)

    def _chunk(self, request: Request, length: int) -> PrefillChunk:
        start = request.num_computed_tokens
        samples = start + length == request.prefill_target and not request.output_token_ids
        return PrefillChunk(request, start, length, samples)

    def _next_chunk(self, request: Request, step: _StepState) -> PrefillChunk:
        length = self._chunk_length(request, step.tokens_left)
        step.tokens_left -= length
        return self._chunk(request, length)

    # -------------------------------------------------------------- preemption helpers

    def _block_demand(self, step: _StepState) -> int:
        return len(step.slot_takers) + sum(p.num_blocks for p in step.pending)

    def _pick_victim(self, step: _StepState) -> Request | None:
        """Least important, then latest arrival; never one admitted this step, and never one at least as
        important as a pending admission (which is what admission counted on)."""
        floor = max((p.request.priority for p in step.pending), default=None)
        candidates = [r for r in self.running
                      if r not in step.admitted and (floor is None or r.priority > floor)]
        return max(candidates, key=_order, default=None)

    def _evict(self, victim: Request, step: _StepState) -> str:
        self.running.remove(victim)
        for chosen in (step.decoders, step.slot_takers):
            if victim in chosen:
                chosen.remove(victim)
        step.plan.prefills = [c for c in step.plan.prefills if c.request is not victim]  # its chunk is off
        victim.num_preemptions += 1
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
            step.plan.swap_out.append(swap)
        victim.status = RequestStatus.SWAPPED
        self.swapped.append(victim)
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

    def check_invariants(self, in_flight: Sequence[Request] = ()) -> None:
        """Raise AssertionError unless pools, queues and requests agree. Meant between steps (after
        postprocess), e.g. after every step in tests. Under async scheduling `in_flight` is the decode batch
        planned and not yet postprocessed, whose requests hold the slot of one more token; when the last plan
        was made ahead, a finished request not yet reaped may hold it too (it ended in the step before)."""
        in_flight = set(in_flight)
        self.kv.check_invariants(self.running + self.waiting + self.swapped)
        queues = ((self.waiting, RequestStatus.WAITING), (self.running, RequestStatus.RUNNING),
                  (self.swapped, RequestStatus.SWAPPED))
        seen = set()
        for queue, status in queues:
            for r in queue:
                _check(r not in seen, f"{r.request_id} queued twice")
                seen.add(r)
                _check(self.requests.get(r.request_id) is r, f"{r.request_id} queued but not tracked")
                _check(r.status is status or (status is RequestStatus.RUNNING and r.is_finished),
                       f"{r.request_id} is {r.status} in the {status.name} queue")
                _check(r.num_tokens == len(r.prompt_token_ids) + len(r.output_token_ids),
                       f"{r.request_id}: num_tokens {r.num_tokens} is not prompt + outputs (append_output bypassed?)")
                expected = cdiv(r.prefill_target + (r in in_flight), self.config.block_size)
                if status is RequestStatus.RUNNING:
                    ahead_slot = self._last_plan_ahead and r.is_finished and len(r.block_ids) == expected + 1
                    _check((len(r.block_ids) == expected or ahead_slot) and not r.host_block_ids,
                           f"{r.request_id}: {len(r.block_ids)} device blocks, expected {expected}")
                elif status is RequestStatus.SWAPPED:  # a swapped request keeps its shared head on the device
                    _check(self.kv.num_blocks(r) == expected,
                           f"{r.request_id}: {len(r.block_ids)} device + {len(r.host_block_ids)} host blocks, "
                           f"expected {expected}")
                else:
                    _check(not r.block_ids and not r.host_block_ids and r.num_computed_tokens == 0,
                           f"{r.request_id}: waiting with {r.num_computed_tokens} computed tokens in "
                           f"{len(r.block_ids)} + {len(r.host_block_ids)} blocks")
        _check(len(seen) == len(self.requests), "tracked requests missing from the queues")
        _check(len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs")
