"""Ref-counted pools of KV-cache blocks: device blocks (block 0 reserved as the null block) and host
(swap) blocks. Allocation is all-or-nothing; a block returns to the free list when its last holder frees it."""

from collections import Counter, deque

# Same id as models.paged.NULL_BLOCK (not imported: this module stays free of jax).
NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    pass


def _check(condition: bool, message: str) -> None:
    # Explicit raise rather than `assert`: invariant checks must survive `python -O`.
    if not condition:
        raise AssertionError(message)


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
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_total}")
        block_ids = [self._free.popleft() for _ in range(n)]
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
        """Drop one reference per listed block; blocks nobody holds go back to the free list."""
        drops = Counter(block_ids)
        for b, n in drops.items():  # validate all first so a bad call changes nothing
            self._require_held(b)
            if self._ref_counts[b] < n:
                raise ValueError(f"block {b} freed {n} times but held {self._ref_counts[b]} times")
        for b in block_ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def _require_held(self, block_id: int) -> None:
        if not self._first_id <= block_id < len(self._ref_counts):
            raise ValueError(f"block {block_id} is reserved or out of range")
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated")

    def check_invariants(self, holders: dict[str, list[int]] | None = None) -> None:
        """Raise AssertionError unless the pool is consistent (and, given every holder's blocks, the ref
        counts equal the number of holdings)."""
        free = set(self._free)
        _check(len(free) == len(self._free), "duplicate block in the free list")
        _check(all(self._first_id <= b < len(self._ref_counts) for b in free), "reserved/out-of-range block free")
        _check(all(self._ref_counts[b] == 0 for b in range(self._first_id)), "reserved block has references")
        _check(all(self._ref_counts[b] == 0 for b in free), "block both free and referenced")
        used = sum(1 for c in self._ref_counts if c > 0)
        _check(all(c >= 0 for c in self._ref_counts), "negative ref count")
        _check(len(free) + used == self.num_total,
               f"free {len(free)} + used {used} != total {self.num_total}")
        if holders is None:
            return
        held = Counter(b for block_ids in holders.values() for b in block_ids)
        for b in held:
            _check(self._first_id <= b < len(self._ref_counts), f"a holder holds reserved/out-of-range block {b}")
        for b in range(self._first_id, len(self._ref_counts)):
            _check(self._ref_counts[b] == held.get(b, 0),
                   f"block {b}: ref count {self._ref_counts[b]} but {held.get(b, 0)} holder(s)")


class BlockPool(_RefCountedBlocks):
    """Device blocks. Block 0 is the null block: padding writes there, so it is never allocated or freed."""

    __slots__ = ()

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, first_id=NULL_BLOCK + 1)


class HostBlockPool(_RefCountedBlocks):
    """Host blocks that hold swapped-out K/V; no null block needed."""

    __slots__ = ()

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, first_id=0)
