"""The scheduler's test harness: a deterministic "model" and a fake worker with a paged KV store that checks
every read, so a block handed to two requests, a swap that lost data, a recompute that skipped tokens or a
prefix-cache hit on the wrong content shows up as a failed read or a changed output. Like the real worker, the
fake one sees the scheduler's steps as plain data (SchedulerOutput) and keeps its own copy of every request,
changed only by the step's diffs and the tokens it samples: a diff the scheduler leaves out shows up too.
Under KV cache groups (SchedulerConfig.group_windows) it keeps every group's copy of each position, and a
sliding group's reads cover only the window: a block freed inside a window reads as the null block."""

import random
from dataclasses import dataclass, field

import numpy as np

from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerConfig, StepPlan
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.worker.input_batch import InputBatch
from engine.worker.packing import SeqSlice, StepLayout, bucket, pack, split_fields

VOCAB = 64
PHASES = ["reap", "budget", "admit", "preempt", "decode"]


def fake_model(tokens: list[int]) -> int:
    """Next token from the whole context (int tuples hash the same in every run)."""
    return hash(tuple(tokens)) % VOCAB


def context_keys(tokens: list[int]) -> list[int]:
    """What a real K/V slot depends on: its token and everything before it (a chained hash per position)."""
    keys, key = [], 0
    for token in tokens:
        key = hash((key, token))
        keys.append(key)
    return keys


@dataclass
class FakeRequest:
    """The fake worker's own copy of a request: its tokens and device blocks."""
    tokens: list[int]
    blocks: list[int]


@dataclass
class FakeWorker:
    """Executes SchedulerOutputs on a dict "KV cache": slot (block, offset) -> (context key, token). A slot is
    right for a request iff it holds the key of that request's own tokens up to that position, whoever wrote
    it: that is exactly when a real model's K/V there could be reused."""

    block_size: int
    group_windows: tuple[int, ...] = (0,)  # each KV cache group's sliding window (0: full attention)
    device: dict[int, list] = field(default_factory=dict)
    host: dict[str, list[list]] = field(default_factory=dict)  # request id -> its swapped-out blocks' contents
    requests: dict[str, FakeRequest] = field(default_factory=dict)

    def _slot(self, request: FakeRequest, position: int, group: int) -> tuple[int, int]:
        block = request.blocks[position // self.block_size * len(self.group_windows) + group]
        assert block != 0, "a request reads/writes the null block"
        return block, position % self.block_size

    def _write(self, request: FakeRequest, position: int, keys: list[int]) -> None:
        for g in range(len(self.group_windows)):
            block, offset = self._slot(request, position, g)
            self.device.setdefault(block, [None] * self.block_size)[offset] = (keys[position],
                                                                              request.tokens[position])

    def _read_context(self, req_id: str, n: int, keys: list[int]) -> list[int]:
        """The request's first n tokens, each slot a query at position n reads checked to hold exactly its token
        in its context: every position in a full group's blocks, the window's in a sliding group's."""
        request = self.requests[req_id]
        for g, window in enumerate(self.group_windows):
            for position in range(max(n - window + 1, 0) if window else 0, n):
                block, offset = self._slot(request, position, g)
                entry = self.device.get(block, [None] * self.block_size)[offset]
                assert entry == (keys[position], request.tokens[position]), (
                    f"{req_id} position {position} group {g}: cache holds {entry}")
        return request.tokens[:n]

    def block_content(self, block: int) -> list | None:
        return self.device.get(block)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self.host.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.host.pop(req_id, None)
        for data in out.new_requests:
            self.requests[data.req_id] = FakeRequest(data.prompt_token_ids + data.output_token_ids,
                                                     list(data.block_ids))
        for req_id, ids in out.new_block_ids.items():
            self.requests[req_id].blocks += ids
        for req_id, fills in out.filled_block_ids.items():
            for entry, block_id in fills:
                self.requests[req_id].blocks[entry] = block_id
        for req_id, device_ids in out.swap_out:  # first, as the contract says
            # The device copy stays: a freed block keeps its K/V until reused (a cached one may be hit).
            self.host[req_id] = [list(self.device.get(d, [None] * self.block_size)) for d in device_ids]
        for req_id, device_ids in out.swap_in:
            contents = self.host.pop(req_id)
            assert len(contents) == len(device_ids)
            for d, content in zip(device_ids, contents):
                self.device[d] = list(content)
        sampled = {}
        for chunk in out.prefills:
            r = self.requests[chunk.req_id]
            keys = context_keys(r.tokens)
            context = self._read_context(chunk.req_id, chunk.start, keys)
            new = r.tokens[chunk.start:chunk.start + chunk.length]
            for i in range(len(new)):
                self._write(r, chunk.start + i, keys)
            if chunk.samples:
                sampled[chunk.req_id] = fake_model(context + new)
        for req_id in out.decodes:
            r = self.requests[req_id]
            position = len(r.tokens) - 1
            keys = context_keys(r.tokens)
            context = self._read_context(req_id, position, keys)
            self._write(r, position, keys)
            sampled[req_id] = fake_model(context + [r.tokens[-1]])
        for req_id, token in sampled.items():  # its tokens are the requests' now, as the real worker's are
            self.requests[req_id].tokens.append(token)
        return ModelRunnerOutput(sampled=sampled)


@dataclass
class Spec:
    rid: str
    arrival_step: int
    prompt_len: int
    max_tokens: int
    priority: int = 0
    eos: tuple[int, ...] = ()
    shared: int = 0            # the prompt's first `shared` tokens are group `group`'s common prefix
    group: int = 0
    salt: str | None = None

    def build(self) -> Request:
        rng = random.Random(self.rid)
        prefix = random.Random(f"prefix {self.group}")
        prompt = ([prefix.randrange(VOCAB) for _ in range(min(self.shared, self.prompt_len))]
                  + [rng.randrange(VOCAB) for _ in range(max(self.prompt_len - self.shared, 0))])
        return Request(self.rid, prompt, self.max_tokens, priority=self.priority, eos_token_ids=self.eos,
                       cache_salt=self.salt)


def reference(spec: Spec, max_model_len: int) -> tuple[list[int], str]:
    """What an unbatched, never-preempted run produces."""
    r = spec.build()
    while True:
        token = fake_model(r.all_token_ids)
        if reason := r.append_output(token, max_model_len):
            return r.output_token_ids, reason


def check_plan(sched: Scheduler, out: SchedulerOutput) -> StepPlan:
    """The step, as scheduled, obeys every rule; returns the scheduler's own record of it."""
    plan = sched.scheduled(out.step)
    c = sched.config
    assert [name for name, _ in plan.trace] == PHASES and out.trace is plan.trace
    info = dict(plan.trace)
    # Blocks freed by reap are already free when the budget is taken, in the same step.
    assert info["reap"]["free_after"] == info["reap"]["free_before"] + info["reap"]["freed_blocks"]
    assert info["budget"]["free"] == info["reap"]["free_after"]
    assert sum(len(r.block_ids) == 0 for r in plan.finished) == len(plan.finished)
    assert len(plan.decodes) <= c.max_num_seqs
    assert out.num_batched_tokens == plan.num_batched_tokens <= c.max_num_batched_tokens
    planned = [ch.request for ch in plan.prefills] + plan.decodes
    assert len(set(map(id, planned))) == len(planned), "a request planned twice"
    for ch in plan.prefills:
        r = ch.request
        assert r.status is RequestStatus.RUNNING and ch.start == r.num_computed_tokens and ch.length >= 1
        assert ch.start + ch.length <= r.prefill_target
        assert ch.samples == (ch.start + ch.length == r.prefill_target and not r.output_token_ids)
        assert len(r.block_ids) == cdiv(r.prefill_target, c.block_size) * len(c.group_windows)
    # Every running request past its prefill decodes, in running order (Scheduler._steady reuses the list)
    assert plan.decodes == [r for r in sched.running if not r.in_prefill]
    for r in plan.decodes:
        assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1
        assert len(r.block_ids) == cdiv(r.num_tokens, c.block_size) * len(c.group_windows)
    for r in plan.preempted:
        assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and not r.block_ids
    # The plain-data step says the same, by request id
    assert [(ch.req_id, ch.start, ch.length, ch.samples) for ch in out.prefills] == [
        (ch.request.request_id, ch.start, ch.length, ch.samples) for ch in plan.prefills]
    assert out.decodes == [r.request_id for r in plan.decodes]
    assert out.preempted_req_ids == [r.request_id for r in plan.preempted + plan.swapped]
    # Pools are consistent mid-step too (running requests hold this step's decode slots already).
    sched.kv.check_invariants(sched.running + sched.swapped)
    return plan


def check_decode_rows(rows: InputBatch, plan: StepPlan, block_size: int, group_windows: tuple[int, ...] = (0,)) -> None:
    """The worker's persistent decode rows, kept by the step's diffs alone, pack exactly the buffer a
    from-scratch rebuild from the scheduler's own requests packs, but for the table entries the scheduler freed
    behind a sliding window: the worker is not told (as in vLLM), and no kernel reads them."""
    groups = len(group_windows)
    if not plan.decodes:
        rows.sync([])  # as ModelRunner._run does: the rows of requests that left go
        return
    n = bucket(len(plan.decodes))
    layout = StepLayout(n, n, rows.tables.shape[1] // groups, n, decode=True, kv_groups=groups)
    rebuilt = pack([SeqSlice([r.last_token_id], r.num_tokens - 1, r.block_ids) for r in plan.decodes], layout,
                   block_size)
    persistent = rows.pack([r.request_id for r in plan.decodes], layout)
    for buf in (rebuilt, persistent):
        tables = split_fields(buf, layout)["block_tables"].reshape(n, -1)
        for row, r in enumerate(plan.decodes):
            for g, window in enumerate(group_windows):
                behind = (r.num_tokens - 1 - window + 1) // block_size if window else 0
                tables[row, g:behind * groups:groups] = 0
    assert persistent.tobytes() == rebuilt.tobytes(), f"step {plan.step}: the persistent decode rows differ"
    assert len(rows) == len(plan.decodes)


def execute_and_update(sched: Scheduler, worker: FakeWorker, out: SchedulerOutput,
                       rows: InputBatch | None = None) -> list[Request]:
    """Execute a step on the fake worker and fold its tokens in, as the engine does. With `rows` (the worker's
    InputBatch, given the step's diffs before it ran), the decode tokens come as one positional list with the
    rows' may_stop mask, which must hold wherever a request stopped on its token (only those rows get the
    stop check); then the rows take the tokens (InputBatch.commit), to the inputs the next check_decode_rows
    compares with a rebuild."""
    result = worker.execute(out)
    if rows is not None and out.decodes:
        tokens = np.array([result.sampled.pop(req_id) for req_id in out.decodes])
        rows.sampled(tokens)
        result.decode_tokens, result.may_stop = tokens.tolist(), rows.may_stop(tokens)
    plan = sched.scheduled(out.step)
    was_finished = [r.is_finished for r in plan.decodes]
    _, finished = sched.update_from_output(out, result)
    for i, r in enumerate(plan.decodes):
        if r.is_finished and not was_finished[i] and result.may_stop is not None:
            assert result.may_stop[i], f"{r.request_id} stopped ({r.finish_reason}) on a row may_stop passed over"
    if rows is not None:
        rows.commit(out, result)
    return finished


def check_cache_contents(sched: Scheduler, worker: FakeWorker, seen: dict[bytes, list]) -> None:
    """The hash table agrees with what the blocks hold: a cached block held by a request holds exactly that
    request's tokens (in their context) at its position, and every cached block, held or free, holds what
    it held when its hash was first seen (`seen`: hash -> block content, kept across steps)."""
    pool, size, groups = sched.kv.device_pool, sched.config.block_size, sched.kv.num_groups
    for r in sched.running + sched.swapped:
        keys, tokens = context_keys(r.all_token_ids), r.all_token_ids
        for entry, block in enumerate(r.block_ids):
            i = entry // groups
            block_hash = pool.block_hash(block) if block else None
            if block_hash is not None:
                span = range(i * size, (i + 1) * size)
                assert worker.block_content(block) == [(keys[p], tokens[p]) for p in span], (
                    f"{r.request_id}: cached block {block} at position {i} holds other K/V")
                seen.setdefault(block_hash, list(worker.block_content(block)))
    for block_hash, block in pool._cached.items():
        assert pool.block_hash(block) == block_hash
        # (A sliding group's block may be published and freed behind its window in one update: first seen free.)
        assert worker.block_content(block) == seen.setdefault(block_hash, list(worker.block_content(block))), (
            f"cached block {block} changed content")


@dataclass
class Run:
    sched: Scheduler
    outputs: dict[str, tuple[list[int], str]]
    first_scheduled: dict[str, int]
    finished_at: dict[str, int]
    decode_rows: InputBatch
    rejected: list[str]
    plans: list[StepPlan]
    chunks: list[tuple[int, str, int, int, int]]  # (plan index, request id, start, length, prefill target then)
    steps: int


def add_arrivals(sched: Scheduler, specs: list[Spec], step: int, requests: dict[str, Request],
                 rejected: list[str]) -> None:
    """Add the specs arriving at `step`: accepted ones into `requests`, the ones that can never fit to `rejected`."""
    for spec in specs:
        if spec.arrival_step == step:
            request = spec.build()
            try:
                sched.add(request)
                requests[spec.rid] = request
            except ValueError:
                rejected.append(spec.rid)


def run(config: SchedulerConfig, specs: list[Spec], aborts: dict[int, list[str]] | None = None,
        max_steps: int = 5000) -> Run:
    """Drive scheduler + fake worker to completion, checking the plan and all invariants every step."""
    sched, worker, aborts = Scheduler(config), FakeWorker(config.block_size, config.group_windows), aborts or {}
    groups = len(config.group_windows)
    decode_rows = InputBatch({}, config.max_num_seqs, cdiv(config.max_model_len, config.block_size) * groups,
                             config.block_size, config.max_model_len)
    requests, rejected, plans, cache_seen = {}, [], [], {}
    first_scheduled, finished_at, chunks = {}, {}, []
    last_arrival = max((s.arrival_step for s in specs), default=0)
    step = 0
    while step <= last_arrival or sched.has_unfinished():
        assert step < max_steps, "workload did not finish: livelock or starvation"
        add_arrivals(sched, specs, step, requests, rejected)
        for rid in aborts.get(step, []):
            status = requests[rid].status if rid in requests else None
            aborted = sched.abort(rid)
            assert (aborted is not None) == (status not in (None, RequestStatus.FINISHED))
            if aborted is not None:
                assert aborted.finish_reason == "abort" and aborted.status is RequestStatus.FINISHED
        sched.check_invariants()
        out = sched.schedule()
        plan = check_plan(sched, out)
        decode_rows.update(out)
        check_decode_rows(decode_rows, plan, config.block_size, config.group_windows)
        plans.append(plan)
        for ch in plan.prefills:
            first_scheduled.setdefault(ch.request.request_id, step)
            chunks.append((step, ch.request.request_id, ch.start, ch.length, ch.request.prefill_target))
        for r in execute_and_update(sched, worker, out, decode_rows):
            finished_at[r.request_id] = step
        sched.check_invariants()
        check_cache_contents(sched, worker, cache_seen)
        step += 1
    # Everything is free at the end, on the device and on the host; the worker holds no request.
    assert sched.kv.device_pool.num_free == sched.kv.device_pool.num_total
    assert sched.kv.host_pool.num_free == sched.kv.host_pool.num_total
    assert not worker.requests and not worker.host and not decode_rows.states
    sched.kv.device_pool.check_invariants({})
    sched.kv.host_pool.check_invariants({})
    outputs = {rid: (r.output_token_ids, r.finish_reason) for rid, r in requests.items()}
    return Run(sched, outputs, first_scheduled, finished_at, decode_rows, rejected, plans, chunks, step)


def advance(sched: Scheduler, worker: FakeWorker, steps: int) -> None:
    """Step a hand-driven scheduler with the same checks as run()."""
    for _ in range(steps):
        out = sched.schedule()
        check_plan(sched, out)
        execute_and_update(sched, worker, out)
        sched.check_invariants()


def config(**overrides) -> SchedulerConfig:
    base = dict(num_blocks=400, block_size=8, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    return SchedulerConfig(**(base | overrides))


def mixed_specs(n: int = 14, seed: int = 0) -> list[Spec]:
    rng = random.Random(seed)
    return [Spec(f"r{i}", rng.randint(0, 12), rng.randint(5, 150), rng.randint(10, 60), rng.choice([0, 1, 2]),
                 eos=(7,) if i % 3 == 0 else ())
            for i in range(n)]
