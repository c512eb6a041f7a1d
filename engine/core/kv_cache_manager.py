"""KVCacheManager: owns the device and host block pools and every change to a request's blocks, and the
automatic prefix cache. The scheduler decides who gets blocks; only this module hands them out.

Prefix caching (vLLM v1's automatic prefix caching, SGLang's RadixAttention as a hash chain):
  - every FULL block of a request's tokens has a hash chained from its parent block's hash and its token
    ids (and, for the first block, the request's optional cache_salt), so equal hashes mean equal tokens
    AND equal context, hence equal K/V;
  - once a block's K/V are written (after the step that computed them), it is published under its hash;
  - admission reuses the longest run of leading published blocks (ref count + 1) and prefills only the
    rest, capped so at least the last token of the prefill target is computed (it yields the logits);
  - freed blocks keep their hash and K/V until their space is needed (block_pool.BlockPool: never-cached
    free blocks go first, then cached ones least recently freed first; sequences free tail first).

KV cache groups (models/paged.KVCacheGroups): a model whose layers mix full and sliding-window attention has G
groups, and a request holds G block ids per logical block, group-minor in one list (entry i * G + g), so every
count here is of block ids. A prompt's sliding-group blocks are taken chunk by chunk (allocate_chunk: the
entries are null placeholders until then), and a sliding group's blocks wholly behind the window of the
request's next query are freed as it advances (free_behind_window; their entries become the null block): a long
sequence holds its context on the full-attention groups and about a window plus a chunk on the sliding ones,
prefill included. A prefix-cache hit needs the logical block cached in every full group (each group's copy
under its own key), and in the sliding groups only the blocks its window reads.
"""

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import NULL_BLOCK, BlockPool, HostBlockPool
from engine.core.invariants import check
from engine.core.request import Request, RequestStatus

ROOT_HASH = bytes(32)  # the parent of a sequence's first block
NO_HOST_BLOCK = -1     # a swapped request's host entry for a block it had freed (behind a window): nothing copied


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent: bytes | None, tokens: Sequence[int], cache_salt: str | None = None) -> bytes:
    """SHA-256 of (parent hash, the block's token ids, for a first block the salt). SHA-256 rather than
    Python's hash(): a 64-bit hash of attacker-chosen prompts can be made to collide, and a collision
    would serve one tenant's K/V to another; SHA-256 also stays equal across processes. The encoding is
    unambiguous: a 32-byte parent, then block_size fixed-width int64 tokens, then 0x01 + salt."""
    digest = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    digest.update(array("q", tokens).tobytes())
    if parent is None and cache_salt is not None:
        digest.update(b"\x01" + cache_salt.encode())
    return digest.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative, like vLLM's prefix_cache_queries / prefix_cache_hits counters (in tokens)."""

    requests: int = 0   # admissions that looked the cache up
    queries: int = 0    # tokens those admissions had to have in the cache (their prefill targets)
    hits: int = 0       # of those, tokens found there (not prefilled)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple[int, ...] = (0,)):
        """`group_windows`: each KV cache group's sliding window (0: full attention), KVCacheGroups.windows."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_groups = len(group_windows)
        self.sliding_groups = tuple(g for g, w in enumerate(group_windows) if w)
        self.full_groups = self.num_groups - len(self.sliding_groups)
        if len({group_windows[g] for g in self.sliding_groups}) > 1:
            raise ValueError(f"KV cache groups with different sliding windows {group_windows} are not supported")
        self.window = group_windows[self.sliding_groups[0]] if self.sliding_groups else 0
        self.device_pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.prefix_stats = PrefixCacheStats()
        # request id -> how many of its leading blocks were published (or were hits): only blocks past
        # it are hashed and published when its computed tokens grow
        self._num_published: dict[str, int] = {}
        # request id -> its leading logical blocks whose sliding-group entries were freed (free_behind_window)
        self._num_behind_window: dict[str, int] = {}

    # -------------------------------------------------------------- sizes

    @property
    def num_total(self) -> int:
        return self.device_pool.num_total

    @property
    def num_free(self) -> int:
        """Free device blocks, evictable cached ones included (they are handed out when needed)."""
        return self.device_pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Block ids (a logical block's in every group) holding num_tokens."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most block ids a request of num_tokens holds at once, in prefill chunks of at most chunk_tokens:
        every block of the full groups; of a sliding group, those of a chunk and the window before it."""
        blocks = cdiv(num_tokens, self.block_size)
        window = cdiv(self.window - 1 + chunk_tokens, self.block_size) + 1
        return blocks * self.full_groups + min(blocks, window) * len(self.sliding_groups)

    def _behind(self, num_tokens: int) -> int:
        """Leading logical blocks a query at position num_tokens reads nothing of (0 without a window)."""
        return max(num_tokens - self.window + 1, 0) // self.block_size if self.sliding_groups else 0

    def _sliding_needed(self, null: list[bool], start: int, end: int) -> int:
        """Sliding-group blocks a prefill chunk of positions [start, end) lacks, over which of a request's block
        entries are null (a logical block past them lacks them all): its window's and its own null ones."""
        groups, needed = self.num_groups, 0
        for i in range(self._behind(start), cdiv(end, self.block_size)):
            needed += sum(i * groups + g >= len(null) or null[i * groups + g] for g in self.sliding_groups)
        return needed

    def chunk_blocks(self, request: Request, end: int) -> int:
        """Blocks the request's next prefill chunk, to position `end`, takes (allocate_chunk); a swapped request's
        host blocks come back as they were."""
        if not self.sliding_groups:
            return 0
        null = [b == NULL_BLOCK for b in request.block_ids] + [h == NO_HOST_BLOCK for h in request.host_block_ids]
        return self._sliding_needed(null, request.num_computed_tokens, end)

    def num_blocks(self, request: Request) -> int:
        """Block entries the request holds: on the device, plus on the host while swapped (freed ones count)."""
        return len(request.block_ids) + len(request.host_block_ids)

    def needs_decode_slot(self, request: Request) -> bool:
        """A decoding request (or one resuming to decode) whose next position starts a new block."""
        return not request.in_prefill and self.blocks_for(request.num_tokens) > self.num_blocks(request)

    def decode_slot_takers(self, decoders: list[Request], ahead: int = 0) -> list[Request]:
        """needs_decode_slot over running decoders (known past their prefill, no host blocks): the scheduler's
        per-step pass over the whole batch, so one comparison each. `ahead`: tokens each has in flight, not yet
        counted in num_tokens (async scheduling), whose slots come first. Each takes num_groups blocks."""
        bs, groups = self.block_size, self.num_groups
        if groups == 1:
            return [r for r in decoders if len(r.block_ids) * bs < r.num_tokens + ahead]
        return [r for r in decoders if len(r.block_ids) * bs < (r.num_tokens + ahead) * groups]

    # -------------------------------------------------------------- admission

    def cached_prefix(self, request: Request) -> list[int]:
        """The published blocks holding the request's leading tokens, as long a run as exists but leaving at
        least the last token of its prefill target to compute. Changes nothing (hashes aside). A request
        reading every prompt row (a scored prompt, as in vLLM, or a mean-pooled embedding) gets none: every
        prompt position must run. Under KV cache
        groups a run needs each logical block in every full-attention group, but in a sliding group only the
        blocks the window of the first computed position reads: the entries behind it are the null block, as
        free_behind_window would leave them."""
        if (not self.enable_prefix_caching or request.block_ids or request.host_block_ids
                or request.reads_every_prompt_row):
            return []
        groups, sliding, pool = self.num_groups, self.sliding_groups, self.device_pool
        found = []  # per logical block of the run: its cached id in each group (None: not cached)
        for block_hash in self._block_hashes(request, (request.prefill_target - 1) // self.block_size):
            block_ids = [pool.cached_block(self._group_key(block_hash, g)) for g in range(groups)]
            if any(block_ids[g] is None for g in range(groups) if g not in sliding):
                break
            found.append(block_ids)
        if not sliding:
            return [b for block_ids in found for b in block_ids]
        for n in range(len(found), 0, -1):  # the longest run whose sliding groups hold their window
            first = self._behind(n * self.block_size)
            if all(found[i][g] is not None for i in range(first, n) for g in sliding):
                return [NULL_BLOCK if g in sliding and i < first else b
                        for i, block_ids in enumerate(found[:n]) for g, b in enumerate(block_ids)]
        return []

    @staticmethod
    def _group_key(block_hash: bytes, group: int) -> bytes:
        """The prefix cache's key of a logical block's copy in `group` (group 0's is the block hash)."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def admission_cost(self, request: Request, hits: list[int], chunk_end: int = 0) -> int:
        """Free blocks that admitting `request` with these hits, its first chunk ending at `chunk_end`, consumes: a
        swapped request's host blocks (and its decode slot, or its chunk's blocks), else the full groups' blocks
        for the rest of its prefill target and the sliding groups' for its chunk; plus every hit on a free
        (evictable) cached block, which leaves the free count. A hit on a held block costs nothing."""
        if request.status is RequestStatus.SWAPPED:
            return (sum(h != NO_HOST_BLOCK for h in request.host_block_ids)
                    + self.needs_decode_slot(request) * self.num_groups
                    + (self.chunk_blocks(request, chunk_end) if request.in_prefill else 0))
        entries = request.block_ids + hits
        held = len(entries) // self.num_groups
        new = (cdiv(request.prefill_target, self.block_size) - held) * self.full_groups
        if self.sliding_groups:
            new += self._sliding_needed([b == NULL_BLOCK for b in entries], held * self.block_size, chunk_end)
        return new + sum(self.device_pool.ref_count(b) == 0 for b in hits if b != NULL_BLOCK)

    def hit_tokens(self, hits: list[int]) -> int:
        """The tokens a waiting request's cache hits hold (where its first chunk starts)."""
        return len(hits) // self.num_groups * self.block_size

    def take_prefix(self, request: Request, hits: list[int]) -> None:
        """Admit a waiting request's cache hits: it holds them and starts computing after them."""
        if request.block_ids or request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r}: only a waiting request without blocks takes hits")
        self.device_pool.touch([b for b in hits if b != NULL_BLOCK])
        request.block_ids = list(hits)
        request.num_computed_tokens = self.hit_tokens(hits)
        self._num_published[request.request_id] = len(hits) // self.num_groups
        if self.enable_prefix_caching:
            self.prefix_stats.requests += 1
            self.prefix_stats.queries += request.prefill_target
            self.prefix_stats.hits += request.num_computed_tokens
        self.free_behind_window(request)

    def allocate_prefill(self, request: Request) -> list[int] | None:
        """New blocks up to the request's whole prefill target, appended to its blocks; None (nothing
        changed) when they don't fit. Sliding groups get null placeholders, filled chunk by chunk
        (allocate_chunk)."""
        missing = self.blocks_for(request.prefill_target) - len(request.block_ids)
        if not self.sliding_groups:
            return self._allocate(request, missing)
        if missing // self.num_groups * self.full_groups > self.device_pool.num_free:
            return None
        new = iter(self.device_pool.allocate(missing // self.num_groups * self.full_groups))
        request.block_ids += [NULL_BLOCK if g in self.sliding_groups else next(new)
                              for _ in range(missing // self.num_groups) for g in range(self.num_groups)]
        return request.block_ids[-missing:] if missing else []

    def allocate_chunk(self, request: Request, end: int) -> list[tuple[int, int]] | None:
        """The sliding-group blocks of a prefill chunk to position `end` and the window before it, into the
        request's null entries: [(entry index, block id)], or None (nothing changed) when they don't fit."""
        if not self.sliding_groups:
            return []
        ids, groups = request.block_ids, self.num_groups
        entries = [i * groups + g for i in range(self._behind(request.num_computed_tokens), cdiv(end, self.block_size))
                   for g in self.sliding_groups if ids[i * groups + g] == NULL_BLOCK]
        if len(entries) > self.device_pool.num_free:
            return None
        fills = list(zip(entries, self.device_pool.allocate(len(entries))))
        for entry, block_id in fills:
            ids[entry] = block_id
        return fills

    def allocate_decode_slots(self, decoders: list[Request]) -> bool:
        """A logical block each (num_groups ids) for running decoders whose next position starts one
        (decode_slot_takers), taken in one pool call; False (nothing changed) when they don't all fit."""
        groups = self.num_groups
        if len(decoders) * groups > self.device_pool.num_free:
            return False
        new = self.device_pool.allocate(len(decoders) * groups)
        if groups == 1:
            for request, block_id in zip(decoders, new):
                request.block_ids.append(block_id)
        else:
            for i, request in enumerate(decoders):
                request.block_ids += new[i * groups:(i + 1) * groups]
        return True

    def _allocate(self, request: Request, n: int) -> list[int] | None:
        if n > self.device_pool.num_free:
            return None
        new = self.device_pool.allocate(n)
        request.block_ids += new
        return new

    def num_held_alone(self, requests: list[Request], exclude: list[int]) -> int:
        """Device blocks that evicting these requests surely frees, swap or recompute: the ones each holds
        alone (a shared block outlives its holder), less `exclude` (an admission's own hits about to be
        shared). O(their blocks)."""
        excluded = set(exclude)
        return sum(self.device_pool.ref_count(b) == 1 and b not in excluded for r in requests for b in r.block_ids)

    # -------------------------------------------------------------- release

    def free(self, request: Request) -> None:
        """Release all of a request's device and host blocks, tail first (so the cache evicts a sequence's
        tail before its head)."""
        self.device_pool.free([b for b in reversed(request.block_ids) if b != NULL_BLOCK])
        self.host_pool.free([h for h in request.host_block_ids if h != NO_HOST_BLOCK])
        self._num_published.pop(request.request_id, None)
        self._num_behind_window.pop(request.request_id, None)
        request.block_ids, request.host_block_ids = [], []

    def free_behind_window(self, request: Request) -> None:
        """Free the request's sliding-group blocks wholly behind the window of its next query (position
        num_computed_tokens, which sees keys after it - window): no step reads them again. Their entries become
        the null block; a published one stays in the prefix cache until its space is needed."""
        if not self.sliding_groups:
            return
        rid, groups = request.request_id, self.num_groups
        behind = self._behind(request.num_computed_tokens)
        done = self._num_behind_window.get(rid, 0)
        if behind <= done:
            return
        ids, freed = request.block_ids, []
        for i in range(done, min(behind, len(ids) // groups)):
            for g in self.sliding_groups:
                if ids[i * groups + g] != NULL_BLOCK:
                    freed.append(ids[i * groups + g])
                    ids[i * groups + g] = NULL_BLOCK
        self.device_pool.free(freed)
        self._num_behind_window[rid] = behind

    def release_host_blocks(self, host_block_ids: list[int]) -> None:
        """Host blocks a swap-in has read (released once no same-step swap-out can be given them)."""
        self.host_pool.free(host_block_ids)

    # -------------------------------------------------------------- swapping

    def swap_out(self, request: Request) -> tuple[list[int], list[int]] | None:
        """Plan moving a running request's K/V to host memory: (device ids, host ids) to copy, or None
        (nothing changed) when the host pool is short. The rule for shared blocks: the leading run of
        blocks that others also hold (cache hits, always a sequence's head) stays on the device, still
        held by the request: copying them would free nothing. Every block from the first one it holds
        alone is copied to the host and freed on the device (a cached one stays in the cache)."""
        keep = 0
        while keep < len(request.block_ids) and self.device_pool.ref_count(request.block_ids[keep]) > 1:
            keep += 1
        entries = request.block_ids[keep:]
        moved = [b for b in entries if b != NULL_BLOCK]  # a freed (behind-window) entry has nothing to copy
        if len(moved) > self.host_pool.num_free:
            return None
        host_ids = self.host_pool.allocate(len(moved))
        self.device_pool.free(moved[::-1])
        request.block_ids = request.block_ids[:keep]
        host = iter(host_ids)
        request.host_block_ids = [NO_HOST_BLOCK if b == NULL_BLOCK else next(host) for b in entries]
        rid = request.request_id
        self._num_published[rid] = min(self._num_published.get(rid, 0), keep // self.num_groups)
        return moved, host_ids

    def swap_in(self, request: Request) -> tuple[list[int], list[int]] | None:
        """Plan bringing a swapped request's host blocks back: (host ids, device ids) to copy, or None
        (nothing changed) when the device is short. The host blocks stay allocated: the caller releases
        them with release_host_blocks once the step's swap-outs were planned."""
        entries = request.host_block_ids
        host_ids = [h for h in entries if h != NO_HOST_BLOCK]
        if len(host_ids) > self.device_pool.num_free:
            return None
        device_ids = self.device_pool.allocate(len(host_ids))
        device = iter(device_ids)
        request.block_ids += [NULL_BLOCK if h == NO_HOST_BLOCK else next(device) for h in entries]
        request.host_block_ids = []
        return host_ids, device_ids

    # -------------------------------------------------------------- the prefix cache

    def publish_computed(self, request: Request) -> None:
        """Publish the request's full blocks whose K/V are now written (call after each step that
        computed tokens for it); an already published content keeps its first block."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        done, full = self._num_published.get(rid, 0), request.num_computed_tokens // self.block_size
        if full <= done:
            return
        hashes, groups, ids = self._block_hashes(request, full), self.num_groups, request.block_ids
        for i in range(done, full):
            for g in range(groups):
                if ids[i * groups + g] != NULL_BLOCK:
                    self.device_pool.cache(ids[i * groups + g], self._group_key(hashes[i], g))
        self._num_published[rid] = full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while any cached block is held."""
        return self.device_pool.reset_cache()

    def _block_hashes(self, request: Request, n: int) -> list[bytes]:
        """The hashes of the request's first n full blocks, extending the ones kept on the request (its
        tokens only ever grow, so they stay valid)."""
        hashes, size = request.block_hashes, self.block_size
        if len(hashes) < n:
            tokens = request.all_token_ids
            for i in range(len(hashes), n):
                hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * size:(i + 1) * size],
                                                request.cache_salt))
        return hashes[:n]

    # -------------------------------------------------------------- observability

    def stats(self) -> dict:
        s = self.prefix_stats
        return {"kv_usage": self.device_pool.usage, "host_usage": self.host_pool.usage,
                "prefix_cache_requests": s.requests, "prefix_cache_queries": s.queries,
                "prefix_cache_hits": s.hits, "prefix_cache_hit_rate": s.hit_rate,
                "prefix_cache_blocks": self.device_pool.num_cached}

    def check_invariants(self, requests: list[Request]) -> None:
        """Raise AssertionError unless both pools agree with the requests' holdings and every cached block
        a request holds carries the hash of that request's tokens at that position."""
        self.device_pool.check_invariants({r.request_id: [b for b in r.block_ids if b != NULL_BLOCK]
                                           for r in requests})
        self.host_pool.check_invariants({r.request_id: [h for h in r.host_block_ids if h != NO_HOST_BLOCK]
                                         for r in requests})
        groups = self.num_groups
        for r in requests:
            for entry, block_id in enumerate(r.block_ids):
                i, g = divmod(entry, groups)
                if block_id == NULL_BLOCK:  # behind the window, or (a placeholder) not computed yet
                    behind = i < self._behind(r.num_computed_tokens)
                    check(g in self.sliding_groups and (behind or i * self.block_size >= r.num_computed_tokens),
                          f"{r.request_id}: entry {entry} is the null block but neither behind a window nor ahead")
                    continue
                block_hash = self.device_pool.block_hash(block_id)
                if block_hash is not None:
                    check(i < r.num_computed_tokens // self.block_size,
                           f"{r.request_id}: cached block {block_id} at position {i} is not fully computed")
                    check(block_hash == self._group_key(self._block_hashes(r, i + 1)[i], g),
                           f"{r.request_id}: block {block_id} at position {i} is cached under another content")
