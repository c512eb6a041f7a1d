"""Ref-counted pools of KV-cache blocks: device blocks (block 0 reserved as the null block, and the prefix
cache's block table) and host (swap) blocks. Allocation is all-or-nothing; a block returns to the free list
when its last holder frees it. Only engine.core.kv_cache_manager changes them."""

from collections import Counter, OrderedDict, deque

from engine.core.invariants import check

# The reserved null block: padding tokens write into it and block tables pad with it; never handed out.
NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    pass


class _RefCountedBlocks:
    """Blocks first_id .. num_blocks-1 are usable; ids below first_id are reserved and never handed out."""

    __slots__ = ("_first_id", "_ref_counts", "_free")

    def __init__(self, num_blocks: int, first_id: int):
        if num_blocks < first_id:
            raise ValueError(f"num_blocks={num_blocks} leaves no room for {first_id} reserved block(s)")
        self._first_id = first_id
        self._ref_counts = [0] * num_blocks
        self._free = deque(range(first_id, num_blocks))  # FIFO: least recently freed is reused first

    @property
    def num_total(self) -> int:
        return len(self._ref_counts) - self._first_id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_total - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_total if self.num_total else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref count 1, or NoFreeBlocks and nothing changed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} free of {self.num_total}")
        block_ids = [self._pop_free() for _ in range(n)]
        for b in block_ids:
            self._ref_counts[b] = 1
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        """Another holder shares these (already held) blocks."""
        for b in block_ids:
            self._require_held(b)
        for b in block_ids:
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per listed block, in order; blocks nobody holds go back to the free list."""
        drops = Counter(block_ids)
        for b, n in drops.items():  # validate all first so a bad call changes nothing
            self._require_held(b)
            if self._ref_counts[b] < n:
                raise ValueError(f"block {b} freed {n} times but held {self._ref_counts[b]} times")
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._push_free(b)

    def _pop_free(self) -> int:
        return self._free.popleft()

    def _push_free(self, block_id: int) -> None:
        self._free.append(block_id)

    def _free_ids(self) -> list[int]:
        return list(self._free)

    def _require_held(self, block_id: int) -> None:
        if not self._first_id <= block_id < len(self._ref_counts):
            raise ValueError(f"block {block_id} is reserved or out of range")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated")

    def check_invariants(self, holders: dict[str, list[int]] | None = None) -> None:
        """Raise AssertionError unless the pool is consistent (and, given every holder's blocks, the ref
        counts equal the number of holdings)."""
        free_ids = self._free_ids()
        free = set(free_ids)
        check(len(free) == len(free_ids), "duplicate block in the free lists")
        check(all(self._first_id <= b < len(self._ref_counts) for b in free), "reserved/out-of-range block free")
        check(all(self._ref_counts[b] == 0 for b in range(self._first_id)), "reserved block has references")
        check(all(self._ref_counts[b] == 0 for b in free), "block both free and referenced")
        used = sum(1 for c in self._ref_counts if c > 0)
        check(all(c >= 0 for c in self._ref_counts), "negative ref count")
        check(len(free) + used == self.num_total,
               f"free {len(free)} + used {used} != total {self.num_total}")
        if holders is None:
            return
        held = Counter(b for block_ids in holders.values() for b in block_ids)
        for b in held:
            check(self._first_id <= b < len(self._ref_counts), f"a holder holds reserved/out-of-range block {b}")
        for b in range(self._first_id, len(self._ref_counts)):
            check(self._ref_counts[b] == held.get(b, 0),
                   f"block {b}: ref count {self._ref_counts[b]} but {held.get(b, 0)} holder(s)")


class BlockPool(_RefCountedBlocks):
    """Device blocks, with the prefix cache's block table. Block 0 is the null block: padding writes there,
    so it is never allocated or freed.

    A block may carry a hash (its content is a known full block of tokens, see engine.core.kv_cache_manager).
    A hashed block whose last holder frees it keeps its hash and its K/V and stays findable by
    `cached_block` until its space is needed. Free blocks thus sit in two queues:
      _free       never hashed (or reset): handed out first, least recently freed first
      _evictable  hashed, ref count 0: handed out (and un-hashed) only when _free is empty, least
                  recently freed first. Callers free a sequence tail-first, so its tail goes before its head.
    Every operation is O(1) per block: an OrderedDict gives removal of a hit from the middle of the queue.
    """

    __slots__ = ("_block_hash", "_cached", "_evictable")

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, first_id=NULL_BLOCK + 1)
        self._block_hash: list[bytes | None] = [None] * num_blocks  # block id -> its content hash, if cached
        self._cached: dict[bytes, int] = {}                         # hash -> the one block cached under it
        self._evictable: OrderedDict[int, None] = OrderedDict()     # hashed free blocks, LRU first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hash[block_id]

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the content with this hash, free or held, or None."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a held, fully written block under `block_hash`. False (nothing changed) when another
        block already holds that content or this block is cached already: one block per hash."""
        self._require_held(block_id)
        if block_hash in self._cached or self._block_hash[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        return True

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference to each cached block (a prefix-cache hit); a free one leaves the
        evictable queue. All are checked before anything changes."""
        for b in block_ids:
            if not self._first_id <= b < len(self._ref_counts) or self._block_hash[b] is None:
                raise ValueError(f"block {b} is not a cached block")
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1

    def reset_cache(self) -> bool:
        """Forget every hash; False (nothing changed) while any cached block is held."""
        if any(self._ref_counts[b] for b in self._cached.values()):
            return False
        for b in self._cached.values():
            self._block_hash[b] = None
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        return True

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._evictable.popitem(last=False)  # evict: its content is about to be overwritten
        del self._cached[self._block_hash[block_id]]
        self._block_hash[block_id] = None
        return block_id

    def _push_free(self, block_id: int) -> None:
        if self._block_hash[block_id] is None:
            self._free.append(block_id)
        else:
            self._evictable[block_id] = None

    def _free_ids(self) -> list[int]:
        return list(self._free) + list(self._evictable)

    def check_invariants(self, holders: dict[str, list[int]] | None = None) -> None:
        super().check_invariants(holders)
        check(all(self._block_hash[b] is None for b in self._free), "a hashed block in the never-cached list")
        check(all(self._block_hash[b] is not None for b in self._evictable),
               "an unhashed block in the evictable queue")
        hashed = sum(h is not None for h in self._block_hash)
        check(len(self._cached) == hashed, f"{len(self._cached)} hashes in the table but {hashed} hashed blocks")
        for block_hash, b in self._cached.items():
            check(self._block_hash[b] == block_hash, f"block {b} is cached under a hash it does not carry")


class HostBlockPool(_RefCountedBlocks):
    """Host blocks that hold swapped-out K/V; no null block needed."""

    __slots__ = ()

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, first_id=0)
