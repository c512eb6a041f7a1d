"""Invariant checks, for tests and debugging: explicit raises rather than `assert`, which `python -O` drops."""

from engine.core.request import RequestStatus


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_scheduler(scheduler) -> None:
    """Raise AssertionError unless a Scheduler's pools, queues and requests agree. Meant between steps (after
    update_from_output), e.g. after every step in tests. Under async scheduling the decode batches scheduled
    and not yet updated hold the slot of one more token each; when the last step was scheduled ahead, a
    finished request not yet reaped may hold it too (it ended in the step before)."""
    in_flight = {r for plan in scheduler._scheduled.values() for r in plan.decodes}
    scheduler.kv.check_invariants(scheduler.running + scheduler.waiting + scheduler.swapped)
    queues = ((scheduler.waiting, RequestStatus.WAITING), (scheduler.running, RequestStatus.RUNNING),
              (scheduler.swapped, RequestStatus.SWAPPED))
    seen = set()
    for queue, status in queues:
        for r in queue:
            check(r not in seen, f"{r.request_id} queued twice")
            seen.add(r)
            check(scheduler.requests.get(r.request_id) is r, f"{r.request_id} queued but not tracked")
            check(r.status is status or (status is RequestStatus.RUNNING and r.is_finished),
                   f"{r.request_id} is {r.status} in the {status.name} queue")
            check(r.num_tokens == len(r.prompt_token_ids) + len(r.output_token_ids),
                   f"{r.request_id}: num_tokens {r.num_tokens} is not prompt + outputs (append_output bypassed?)")
            expected = scheduler.kv.blocks_for(r.prefill_target + (r in in_flight))
            if status is RequestStatus.RUNNING:
                ahead_slot = (scheduler._last_plan_ahead and r.is_finished
                              and len(r.block_ids) == expected + scheduler.kv.num_groups)
                check((len(r.block_ids) == expected or ahead_slot) and not r.host_block_ids,
                       f"{r.request_id}: {len(r.block_ids)} device blocks, expected {expected}")
            elif status is RequestStatus.SWAPPED:  # a swapped request keeps its shared head on the device
                check(scheduler.kv.num_blocks(r) == expected,
                       f"{r.request_id}: {len(r.block_ids)} device + {len(r.host_block_ids)} host blocks, "
                       f"expected {expected}")
            else:
                check(not r.block_ids and not r.host_block_ids and r.num_computed_tokens == 0,
                       f"{r.request_id}: waiting with {r.num_computed_tokens} computed tokens in "
                       f"{len(r.block_ids)} + {len(r.host_block_ids)} blocks")
    check(len(seen) == len(scheduler.requests), "tracked requests missing from the queues")
    check(len(scheduler.running) <= scheduler.config.max_num_seqs, "more running requests than max_num_seqs")
