"""KVCacheManager and the prefix cache, in the style of vLLM's test_prefix_caching.py: hits while the first
holder runs and after it finished, exact eviction order, all-or-nothing allocation, salts, reset, and the
swap rule for shared blocks. Randomized workloads through the scheduler live in test_scheduler.py."""

import random

import pytest

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import ModelRunnerOutput

BLOCK = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), max_tokens=8, cache_salt=salt)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request that fits: take the hits, allocate the rest (the whole
    prefill one chunk)."""
    hits = kv.cached_prefix(request)
    kv.take_prefix(request, hits)
    assert kv.allocate_prefill(request) is not None
    assert kv.allocate_chunk(request, request.prefill_target) is not None
    request.status = RequestStatus.RUNNING
    return hits


def compute_prefill(kv: KVCacheManager, request: Request) -> None:
    """The runner wrote the rest of the prefill target: publish its full blocks."""
    request.num_computed_tokens = request.prefill_target
    kv.publish_computed(request)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def check(kv: KVCacheManager, *requests: Request) -> None:
    kv.check_invariants(list(requests))
    pool = kv.device_pool
    assert pool.num_free + pool.num_used == pool.num_total


def test_block_hashes_chain_parent_tokens_and_salt():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    first = hash_block_tokens(None, a)
    assert hash_block_tokens(first, b) != hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 5]), b)
    assert hash_block_tokens(None, a) == first and len(first) == 32  # stable across calls (and processes)
    assert len({first, hash_block_tokens(None, a, "x"), hash_block_tokens(None, a, ""),
                hash_block_tokens(None, a, "y")}) == 4
    assert hash_block_tokens(first, b, "x") == hash_block_tokens(first, b)  # the salt lives in the first block


def test_hit_while_the_first_request_runs_shares_blocks_with_ref_count_2():
    kv = KVCacheManager(num_blocks=11, num_host_blocks=0, block_size=BLOCK)
    prefix = random_tokens(3 * BLOCK, seed=1)
    a = make_request("a", prefix + [7, 7])            # 14 tokens: 3 full blocks + a partial one
    assert admit(kv, a) == []
    compute_prefill(kv, a)
    assert kv.device_pool.num_cached == 3
    b = make_request("b", prefix + [9, 9, 9])
    hits = admit(kv, b)
    assert hits == a.block_ids[:3] and b.num_computed_tokens == 3 * BLOCK
    assert [kv.device_pool.ref_count(x) for x in a.block_ids] == [2, 2, 2, 1]
    assert b.block_ids[3] != a.block_ids[3] and len(b.block_ids) == 4
    assert kv.prefix_stats.queries == 14 + 15 and kv.prefix_stats.hits == 12
    check(kv, a, b)
    kv.free(a)
    assert [kv.device_pool.ref_count(x) for x in b.block_ids[:3]] == [1, 1, 1]
    check(kv, b)


def test_hit_after_the_first_request_finished_takes_blocks_back_from_the_free_list():
    kv = KVCacheManager(num_blocks=9, num_host_blocks=0, block_size=BLOCK)
    prompt = random_tokens(2 * BLOCK + 1, seed=2)
    a = make_request("a", prompt)
    admit(kv, a)
    compute_prefill(kv, a)
    blocks = list(a.block_ids)
    kv.free(a)
    assert kv.num_free == kv.num_total and kv.device_pool.num_cached == 2  # free, yet still cached
    b = make_request("b", prompt)
    hits = kv.cached_prefix(b)
    assert hits == blocks[:2]
    assert kv.admission_cost(b, hits) == 1 + 2  # one new block, and the two hits leave the free list
    kv.take_prefix(b, hits)
    assert kv.num_free == kv.num_total - 2 and [kv.device_pool.ref_count(x) for x in hits] == [1, 1]
    assert kv.allocate_prefill(b) is not None and b.num_computed_tokens == 2 * BLOCK
    check(kv, b)


def test_at_least_the_last_prompt_token_is_computed():
    kv = KVCacheManager(num_blocks=9, num_host_blocks=0, block_size=BLOCK)
    prompt = random_tokens(2 * BLOCK, seed=3)  # exactly two full blocks
    a = make_request("a", prompt)
    admit(kv, a)
    compute_prefill(kv, a)
    b = make_request("b", prompt)
    assert kv.cached_prefix(b) == a.block_ids[:1]  # the second block holds the last token: recomputed
    one = make_request("one", prompt[:1])
    assert kv.cached_prefix(one) == []


def test_a_request_scoring_its_prompt_gets_no_hits_but_publishes():
    from engine.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=12, num_host_blocks=0, block_size=BLOCK)
    prompt = random_tokens(2 * BLOCK + 1, seed=18)
    a = make_request("a", prompt)
    admit(kv, a)
    compute_prefill(kv, a)
    scoring = make_request("scoring", prompt)
    scoring.params = SamplingParams(prompt_logprobs=1)
    assert kv.cached_prefix(scoring) == []
    plain = make_request("plain", prompt)
    plain.params = SamplingParams(logprobs=1)
    assert kv.cached_prefix(plain) == a.block_ids[:2]


def test_exact_eviction_order_never_cached_first_then_lru_tail_before_head():
    kv = KVCacheManager(num_blocks=9, num_host_blocks=0, block_size=BLOCK)  # blocks 1..8
    a = make_request("a", random_tokens(3 * BLOCK + 1, seed=4))  # 3 cached + 1 partial
    b = make_request("b", random_tokens(2 * BLOCK + 1, seed=5))  # 2 cached + 1 partial
    admit(kv, a)
    admit(kv, b)
    assert a.block_ids == [1, 2, 3, 4] and b.block_ids == [5, 6, 7]
    compute_prefill(kv, a)
    compute_prefill(kv, b)
    kv.free(a)  # freed first: least recently used
    kv.free(b)
    probe = make_request("probe", [0] * (8 * BLOCK))
    order = [kv.device_pool.allocate(1)[0] for _ in range(8)]
    # Never-cached first (8, never used; then the partial tails 4 and 7 in the order freed), then the
    # cached ones least recently freed first, each sequence tail before head.
    assert order == [8, 4, 7, 3, 2, 1, 6, 5]
    assert kv.device_pool.num_cached == 0 and kv.cached_prefix(probe) == []


def test_a_hit_refreshes_a_block_in_the_lru_order():
    kv = KVCacheManager(num_blocks=5, num_host_blocks=0, block_size=BLOCK)  # blocks 1..4
    a = make_request("a", random_tokens(BLOCK + 1, seed=6))
    b = make_request("b", random_tokens(BLOCK + 1, seed=7))
    for r in (a, b):
        admit(kv, r)
        compute_prefill(kv, r)
    kv.free(a)
    kv.free(b)
    again = make_request("a2", a.prompt_token_ids)
    admit(kv, again)   # a's block 1 is hit; a's tail 2 is reused (never cached)
    assert again.block_ids == [1, 2]
    kv.free(again)     # block 1 is now the most recently freed
    assert [kv.device_pool.allocate(1)[0] for _ in range(4)] == [4, 2, 3, 1]


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=6, num_host_blocks=0, block_size=BLOCK)  # 5 blocks
    prompt = random_tokens(2 * BLOCK + 2, seed=8)
    a = make_request("a", prompt)
    admit(kv, a)
    compute_prefill(kv, a)
    big = make_request("big", prompt[:2 * BLOCK] + random_tokens(3 * BLOCK, seed=9))
    hits = kv.cached_prefix(big)
    kv.take_prefix(big, hits)
    refs = [kv.device_pool.ref_count(b) for b in range(1, 6)]
    assert kv.allocate_prefill(big) is None  # needs 3 more, 2 free
    assert [kv.device_pool.ref_count(b) for b in range(1, 6)] == refs and big.block_ids == hits
    assert kv.num_free == 2 and kv.device_pool.num_cached == 2
    kv.free(big)
    assert [kv.device_pool.ref_count(b) for b in a.block_ids] == [1, 1, 1] and kv.num_free == 2
    check(kv, a)


def test_salts_separate_caches():
    kv = KVCacheManager(num_blocks=12, num_host_blocks=0, block_size=BLOCK)
    prompt = random_tokens(3 * BLOCK, seed=11)
    a = make_request("a", prompt, salt="tenant-a")
    admit(kv, a)
    compute_prefill(kv, a)
    assert kv.cached_prefix(make_request("plain", prompt)) == []
    assert kv.cached_prefix(make_request("b", prompt, salt="tenant-b")) == []
    assert kv.cached_prefix(make_request("a2", prompt, salt="tenant-a")) == a.block_ids[:2]


def test_reset_is_refused_while_cached_blocks_are_held():
    kv = KVCacheManager(num_blocks=9, num_host_blocks=0, block_size=BLOCK)
    prompt = random_tokens(2 * BLOCK + 1, seed=12)
    a = make_request("a", prompt)
    admit(kv, a)
    compute_prefill(kv, a)
    assert not kv.reset_prefix_cache() and kv.device_pool.num_cached == 2
    kv.free(a)
    assert kv.reset_prefix_cache() and kv.device_pool.num_cached == 0 and kv.num_free == kv.num_total
    assert kv.cached_prefix(make_request("b", prompt)) == []
    check(kv)


def test_swap_out_keeps_the_shared_head_on_the_device_and_copies_the_rest():
    kv = KVCacheManager(num_blocks=12, num_host_blocks=8, block_size=BLOCK)
    prefix = random_tokens(2 * BLOCK, seed=13)
    a = make_request("a", prefix + [1, 2, 3])
    admit(kv, a)
    compute_prefill(kv, a)
    b = make_request("b", prefix + random_tokens(BLOCK + 2, seed=14))
    admit(kv, b)
    compute_prefill(kv, b)
    shared, own = b.block_ids[:2], b.block_ids[2:]
    device_ids, host_ids = kv.swap_out(b)
    assert device_ids == own and len(host_ids) == 2
    assert b.block_ids == shared and b.host_block_ids == host_ids
    assert [kv.device_pool.ref_count(x) for x in shared] == [2, 2]
    b.status = RequestStatus.SWAPPED
    check(kv, a, b)
    host_back, device_back = kv.swap_in(b)
    assert host_back == host_ids and b.block_ids == shared + device_back and not b.host_block_ids
    kv.release_host_blocks(host_back)
    kv.publish_computed(b)  # its third block is cached already (it kept its hash while free): not twice
    b.status = RequestStatus.RUNNING
    check(kv, a, b)
    # The host pool too small: nothing changes.
    small = KVCacheManager(num_blocks=12, num_host_blocks=1, block_size=BLOCK)
    c = make_request("c", random_tokens(3 * BLOCK, seed=15))
    admit(small, c)
    before = list(c.block_ids)
    assert small.swap_out(c) is None and c.block_ids == before and small.host_pool.num_free == 1


def test_duplicate_content_keeps_one_cached_block():
    """Two requests prefilling the same prompt in the same step both compute it; the first published
    block stays the one cached, the second is an ordinary block (freed to the never-cached list)."""
    kv = KVCacheManager(num_blocks=9, num_host_blocks=0, block_size=BLOCK)
    prompt = random_tokens(BLOCK + 1, seed=16)
    a, b = make_request("a", prompt), make_request("b", prompt)
    admit(kv, a)
    admit(kv, b)
    compute_prefill(kv, a)
    compute_prefill(kv, b)
    assert kv.device_pool.block_hash(a.block_ids[0]) is not None and kv.device_pool.block_hash(b.block_ids[0]) is None
    check(kv, a, b)


def test_pool_rejects_hits_on_uncached_blocks_and_publishing_free_blocks():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="not a cached block"):
        pool.touch([1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.cache(1, b"x" * 32)
    (b,) = pool.allocate(1)
    assert pool.cache(b, b"h" * 32) and not pool.cache(b, b"g" * 32)
    pool.free([b])
    pool.touch([b])
    assert pool.ref_count(b) == 1 and pool.num_free == 2
    pool.check_invariants({"x": [b]})


def test_server_metrics_count_prefix_cache_queries_and_hits():
    from engine.core.scheduler import Scheduler, SchedulerConfig
    from engine.entrypoints.metrics import ServerMetrics

    sched = Scheduler(SchedulerConfig(num_blocks=20, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64))
    metrics = ServerMetrics("m")
    prompt = random_tokens(3 * BLOCK + 1, seed=17)
    for rid in ("a", "b"):
        sched.add(make_request(rid, prompt))
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(sampled={r: 1 for r in out.decodes}
                                                        | {c.req_id: 1 for c in out.prefills}))
        metrics.record_scheduler_stats(sched.stats())
    metrics.record_scheduler_stats(sched.stats())  # counted once, however often it is recorded
    text = metrics.render()[0].decode()
    assert 'ferry:prefix_cache_queries_total{model_name="m"} 26.0' in text
    assert 'ferry:prefix_cache_hits_total{model_name="m"} 12.0' in text
    assert 'ferry:prefix_cache_hit_rate{model_name="m"} ' + str(12 / 26) in text


# ------------------------------------------------------------------ KV cache groups and sliding windows

def test_sliding_group_holds_about_a_window_and_its_hits_need_every_group():
    """Groups (full, sliding 10): a request holds a block id of each group per logical block; as it advances,
    the sliding group's blocks wholly behind the next query's window go back to the pool (null entries) while
    the full group's stay. A second request with the same prompt hits only where every group's copy is cached,
    and then frees its own sliding hits behind the window at once."""
    kv = KVCacheManager(num_blocks=200, num_host_blocks=0, block_size=BLOCK, group_windows=(0, 10))
    prompt = random_tokens(41, 0)
    a = make_request("a", prompt)
    admit(kv, a)
    assert len(a.block_ids) == 2 * 11  # 41 tokens: 11 logical blocks, two ids each
    compute_prefill(kv, a)
    kv.free_behind_window(a)
    # The next query (position 41) sees keys 32..41: logical blocks 0-7 (positions < 32) are behind it.
    behind = (41 - 10 + 1) // BLOCK
    assert behind == 8
    assert a.block_ids[1:2 * behind:2] == [0] * behind and 0 not in a.block_ids[0::2]
    assert 0 not in a.block_ids[2 * behind + 1::2]
    assert kv.num_free == kv.num_total - (22 - behind)
    check(kv, a)
    for _ in range(40):  # decode on: the sliding group stays at about a window of blocks
        a.num_computed_tokens = a.num_tokens
        a.append_output(5, 10_000)
        if kv.needs_decode_slot(a):
            assert kv.allocate_decode_slots([a])
        kv.publish_computed(a)
        kv.free_behind_window(a)
    sliding_held = sum(b != 0 for b in a.block_ids[1::2])
    assert sliding_held <= 10 // BLOCK + 2 and sum(b != 0 for b in a.block_ids[0::2]) == len(a.block_ids) // 2
    check(kv, a)
    # Same prompt: blocks 0-7 of the sliding group were freed but stay cached (evictable): full hits.
    b = make_request("b", prompt)
    hits = admit(kv, b)
    assert len(hits) == 2 * 10  # (41 - 1) // 4 logical blocks, both groups
    # Its sliding hits behind its next query's window (position 40: keys 31..40) went back at once.
    assert b.block_ids[1::2] == [0] * 7 + hits[15::2] + b.block_ids[21::2] and 0 not in b.block_ids[15::2]
    check(kv, a, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_free == kv.num_total


def test_swap_of_a_windowed_request_copies_only_live_blocks():
    kv = KVCacheManager(num_blocks=100, num_host_blocks=100, block_size=BLOCK, group_windows=(0, 6),
                        enable_prefix_caching=False)
    a = make_request("a", random_tokens(30, 1))
    admit(kv, a)
    compute_prefill(kv, a)
    kv.free_behind_window(a)
    entries = list(a.block_ids)
    live = [b for b in entries if b != 0]
    moved, host = kv.swap_out(a)
    assert moved == live and len(host) == len(live) and not a.block_ids
    assert len(a.host_block_ids) == len(entries)  # aligned, the freed entries marked
    a.status = RequestStatus.SWAPPED
    check(kv, a)
    host_ids, device_ids = kv.swap_in(a)
    assert host_ids == host and len(device_ids) == len(live)
    assert [b == 0 for b in a.block_ids] == [b == 0 for b in entries]
    kv.release_host_blocks(host_ids)
    check(kv, a)


def test_a_hit_needs_only_the_sliding_blocks_of_its_window():
    """The first request's sliding blocks behind its window are freed and then evicted (their space was needed);
    a second request over the same 44 tokens still hits all 11 logical blocks: the full group's, and of the
    sliding group only those the window of its first computed position (44) reads; the rest are null."""
    kv = KVCacheManager(num_blocks=1 + 2 * 11, num_host_blocks=0, block_size=BLOCK, group_windows=(0, 10))
    prompt = random_tokens(44, 3)
    a = make_request("a", prompt)
    admit(kv, a)
    compute_prefill(kv, a)
    kv.free_behind_window(a)  # the next query (44) sees keys 35..44: sliding blocks 0-7 go
    assert kv.num_free == 8
    filler = make_request("filler", random_tokens(16, 4))  # 4 logical blocks: 8 ids
    kv.take_prefix(filler, [])
    assert kv.allocate_prefill(filler) is not None  # takes (evicts) exactly those 8
    kv.free(filler)
    b = make_request("b", prompt + random_tokens(5, 5))
    hits = kv.cached_prefix(b)
    assert len(hits) == 2 * 11
    assert hits[0::2] == a.block_ids[0::2] and hits[1::2] == [0] * 8 + a.block_ids[17::2]
    assert kv.admission_cost(b, hits) == 13 - 11  # the full group's rest alone, and with its chunk the sliding:
    assert kv.admission_cost(b, hits, b.prefill_target) == 2 * 13 - 2 * 11
    kv.take_prefix(b, hits)
    assert b.num_computed_tokens == 44
    check(kv, a, b)
