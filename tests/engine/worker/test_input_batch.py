"""The worker's persistent decode batch (InputBatch), kept by the scheduler's diffs and its own sampled tokens:
every buffer it packs equals a from-scratch pack of the scheduler's view of the same requests."""

import random

import numpy as np

from engine.core.kv_cache_manager import cdiv
from engine.core.request import Request
from engine.core.scheduler import StepPlan
from engine.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.worker.input_batch import InputBatch
from engine.worker.packing import SeqSlice, StepLayout, pack
from helpers.scheduler_harness import check_decode_rows


def _new(r: Request) -> NewRequestData:
    return NewRequestData(r.request_id, list(r.prompt_token_ids), list(r.output_token_ids), list(r.block_ids),
                          None, 0, r.max_tokens, 0, r.eos_token_ids, False, False)


def test_decode_rows_survive_reruns_and_partial_runs():
    """Fault isolation's pattern on the persistent rows: a step packed again before its tokens are committed (a
    rerun) packs the same inputs, and runs of parts of the batch (which release each other's rows) advance only
    the rows that kept their request. Every buffer equals a from-scratch pack; may_stop flags EOS and the last
    token."""
    bs, rng = 4, random.Random(0)
    rows, next_block = InputBatch({}, 4, 8, bs, 32), iter(range(1, 100))
    batch = [Request(f"r{i}", [3 + i] * (2 + 3 * i), max_tokens=9, eos_token_ids=(2,)) for i in range(3)]
    for r in batch:
        r.output_token_ids.append(5)
        r.num_tokens += 1
        r.block_ids = [next(next_block) for _ in range(cdiv(r.num_tokens, bs))]
    rows.update(SchedulerOutput(0, new_requests=[_new(r) for r in batch]))

    def run(requests):  # pack (checked against a rebuild), then the sampled tokens
        check_decode_rows(rows, StepPlan(0, decodes=requests), bs)
        tokens = np.array([rng.choice([2, 6, 7]) for _ in requests])
        rows.sampled(tokens)
        may_stop = rows.may_stop(tokens)
        for r, token, flagged in zip(requests, tokens.tolist(), may_stop.tolist()):
            assert flagged == (token == 2 or r.num_output_tokens + 1 >= r.max_tokens)
        return dict(zip([r.request_id for r in requests], tokens.tolist()))

    for step in range(8):
        sampled = run(batch)
        if step % 3 == 1:  # a rerun of the whole step
            sampled = run(batch)
        elif step % 3 == 2:  # the whole call failed: then each half alone
            sampled = run(batch[:1]) | run(batch[1:])
        new_blocks = {}
        for r in batch:  # the scheduler's update, then its new decode slot
            r.output_token_ids.append(sampled[r.request_id])
            r.num_tokens += 1
            if len(r.block_ids) * bs < r.num_tokens:
                r.block_ids.append(next(next_block))
                new_blocks[r.request_id] = r.block_ids[-1:]
        ids = [r.request_id for r in batch]
        rows.commit(SchedulerOutput(step, decodes=ids), ModelRunnerOutput(sampled=sampled))
        rows.update(SchedulerOutput(step + 1, new_block_ids=new_blocks))
    check_decode_rows(rows, StepPlan(0, decodes=batch), bs)


def test_decode_rows_feed_a_dispatched_step_and_learn_its_tokens():
    """The rows across dispatch and land: the next pack feeds each row its own output of the last call
    (token_source = its index there) one position on, and after the land its tokens come from the host again;
    apart from token ids and token_source, every buffer equals a from-scratch pack."""
    bs, rows = 4, InputBatch({}, 4, 8, 4, 32)
    requests = [Request(f"q{i}", prompt_token_ids=list(range(5 + i)), max_tokens=20) for i in range(3)]
    for i, r in enumerate(requests):
        r.block_ids, r.num_computed_tokens = [1 + 8 * i + j for j in range(8)], r.num_tokens - 1
    rows.update(SchedulerOutput(0, new_requests=[_new(r) for r in requests]))
    layout = StepLayout(4, 4, 8, 4, decode=True)

    def check(buf, tokens, sources):
        names = [name for name, _ in layout.sizes()]
        fields = dict(zip(names, np.split(buf, np.cumsum([n for _, n in layout.sizes()])[:-1])))
        ref = dict(zip(names, np.split(pack([SeqSlice([r.last_token_id], r.num_tokens - 1, r.block_ids)
                                              for r in requests], layout, bs),
                                       np.cumsum([n for _, n in layout.sizes()])[:-1])))
        for name in names:
            if name not in ("token_ids", "token_source"):
                np.testing.assert_array_equal(fields[name], ref[name], err_msg=name)
        assert fields["token_source"].tolist() == sources
        known = [i for i, s in enumerate(sources[:len(requests)]) if s < 0]
        assert [fields["token_ids"][i] for i in known] == [tokens[i] for i in known]

    def advance(tokens):  # the next step's view of the requests: one token further
        for r, token in zip(requests, tokens):
            r.output_token_ids.append(token)
            r.num_tokens += 1
            r.num_computed_tokens += 1

    ids = lambda: [r.request_id for r in requests]  # noqa: E731
    check(rows.pack(ids(), layout), [r.last_token_id for r in requests], [-1, -1, -1, -1])
    first = rows.packed_rows(), rows.dispatched()
    advance([-1] * 3)  # not known on the host yet
    check(rows.pack(ids(), layout), None, [0, 1, 2, -1])
    second = rows.packed_rows(), rows.dispatched()
    rows.landed(*first, np.array([11, 12, 13]))  # every row was dispatched again since: nothing changes
    advance([-1] * 3)
    check(rows.pack(ids(), layout), None, [0, 1, 2, -1])
    rows.sync(ids()[:2])  # q2 leaves the batch (its row is released)
    rows.landed(*second, np.array([21, 22, 23]))
    for r, token in zip(requests, (11, 12, 13)):
        r.output_token_ids[-2] = token
    for r, token in zip(requests, (21, 22, 23)):
        r.output_token_ids[-1] = token
    requests = requests[:2]
    check(rows.pack(ids(), layout), [21, 22], [-1, -1, -1, -1])
