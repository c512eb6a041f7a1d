import pytest

from engine.core.block_pool import NULL_BLOCK, BlockPool, HostBlockPool, NoFreeBlocks


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.num_total == 4 and pool.num_free == 4 and pool.num_used == 0
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_BLOCK not in got
    assert pool.num_free == 0 and pool.usage == 1.0
    pool.check_invariants({"a": got})
    with pytest.raises(ValueError):
        pool.free([NULL_BLOCK])
    with pytest.raises(ValueError):
        pool.incref([NULL_BLOCK])


def test_the_null_block_is_never_handed_out():
    """Every usable block can be allocated, and none of them is the null block (padding writes there)."""
    pool = BlockPool(5)
    assert sorted(pool.allocate(pool.num_total)) == [b for b in range(5) if b != NULL_BLOCK]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_allocate_free_fifo():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert a == [1, 2] and b == [3, 4, 5]
    pool.free(a)
    assert pool.num_free == 2 and pool.num_used == 3
    assert pool.allocate(1) == [1]  # least recently freed first
    pool.check_invariants({"b": b, "c": [1]})


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    held = pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.num_used == 2
    pool.check_invariants({"a": held})
    assert pool.allocate(1) == [3]
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_incref_shares_until_last_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.check_invariants({"a": blocks, "b": blocks})
    pool.free(blocks)
    assert pool.num_free == 1  # still held by "b"
    pool.check_invariants({"b": blocks})
    pool.free(blocks)
    assert pool.num_free == 3
    pool.check_invariants({})
    with pytest.raises(ValueError):
        pool.incref(blocks)  # only held blocks can be shared


def test_bad_free_changes_nothing():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([blocks[0], 3])  # 3 is not allocated
    with pytest.raises(ValueError):
        pool.free([blocks[0], blocks[0]])  # freed twice, held once
    with pytest.raises(ValueError):
        pool.free([99])
    assert pool.num_free == 1
    pool.check_invariants({"a": blocks})


def test_invariants_catch_wrong_holders():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants({"a": blocks[:1]})
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants({"a": blocks, "b": blocks[:1]})
    with pytest.raises(AssertionError, match="reserved"):
        pool.check_invariants({"a": blocks + [NULL_BLOCK]})


def test_invariants_catch_corrupted_free_list():
    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.append(pool._free[0])
    with pytest.raises(AssertionError, match="duplicate"):
        pool.check_invariants()
    pool = BlockPool(4)
    pool._free.append(NULL_BLOCK)
    with pytest.raises(AssertionError, match="reserved"):
        pool.check_invariants()
    pool = BlockPool(4)
    held = pool.allocate(1)
    pool._free.append(held[0])
    with pytest.raises(AssertionError, match="both free and referenced"):
        pool.check_invariants()


def test_host_pool_has_no_reserved_block():
    pool = HostBlockPool(3)
    assert pool.num_total == 3
    got = pool.allocate(3)
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.check_invariants({"a": got})
    pool.free(got)
    assert pool.num_free == 3 and pool.usage == 0.0
    pool.check_invariants({})
    empty = HostBlockPool(0)
    assert empty.num_total == 0 and empty.usage == 0.0 and empty.allocate(0) == []
    with pytest.raises(NoFreeBlocks):
        empty.allocate(1)
