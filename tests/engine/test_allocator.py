"""Block allocator with tiny pools and exact block ids; the CPU pool's storage."""

import sys
from pathlib import Path

import pytest

from tokenfleet.kvcache import BlockAllocator


def test_allocate_hands_out_lowest_free_blocks_in_order():
    a = BlockAllocator(num_blocks=6, block_size=4)
    assert a.allocate("x", 5) == [0, 1]
    assert a.allocate("y", 4) == [2]
    assert a.num_free_blocks == 3 and a.num_used_blocks == 3
    assert a.slot("x", 4) == 1 * 4 + 0
    a.check_integrity()


def test_append_slot_grows_into_a_new_block_at_the_boundary():
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.allocate("x", 2)  # block 0 full
    assert a.append_slot("x") == 1 * 2 + 0  # new block 1, offset 0
    assert a.append_slot("x") == 1 * 2 + 1
    assert a.block_table("x") == [0, 1]
    assert a.num_tokens("x") == 4


def test_exhaustion_is_a_value_not_an_exception():
    a = BlockAllocator(num_blocks=2, block_size=2)
    assert a.allocate("x", 4) == [0, 1]
    assert not a.can_allocate(1)
    assert a.allocate("y", 1) is None
    assert a.append_slot("x") is None  # full block, no free block
    assert a.num_tokens("x") == 4  # unchanged by the failed append
    a.check_integrity()


def test_free_and_reuse_order():
    a = BlockAllocator(num_blocks=5, block_size=2)
    a.allocate("x", 3)  # [0, 1]
    a.allocate("y", 2)  # [2]
    a.free("x")  # free list: 3, 4, 0, 1
    assert a.allocate("z", 6) == [3, 4, 0]
    assert a.allocate("w", 2) == [1]
    a.check_integrity()


def test_can_allocate_respects_reserve():
    a = BlockAllocator(num_blocks=4, block_size=4)
    assert a.can_allocate(8, reserve_blocks=2)
    assert not a.can_allocate(8, reserve_blocks=3)


def test_misuse_raises():
    a = BlockAllocator(num_blocks=4, block_size=4)
    a.allocate("x", 1)
    with pytest.raises(ValueError):
        a.allocate("x", 1)
    with pytest.raises(ValueError):
        a.free("nobody")
    with pytest.raises(ValueError):
        a.append_slot("nobody")
    with pytest.raises(ValueError):
        a.allocate("y", 0)
    with pytest.raises(ValueError):
        BlockAllocator(0, 4)


def test_integrity_check_catches_a_block_owned_twice_and_a_lost_block():
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.allocate("x", 2)
    a._tables["x"].append(a._free[0])  # owned and free at once
    with pytest.raises(RuntimeError):
        a.check_integrity()
    b = BlockAllocator(num_blocks=4, block_size=2)
    b._free.pop()  # a block nobody owns
    with pytest.raises(RuntimeError):
        b.check_integrity()


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="transparent huge pages: Linux, not disabled",
)
def test_the_cpu_pool_asks_for_huge_pages_and_starts_zeroed():
    import torch

    from tokenfleet.kvcache.store import HUGE_PAGE, PagedKVStore, advise_huge_pages

    assert advise_huge_pages(torch.empty(HUGE_PAGE // 4, dtype=torch.uint8)) == 0  # no whole huge page
    big = torch.empty(8 * HUGE_PAGE, dtype=torch.uint8)
    assert 6 * HUGE_PAGE <= advise_huge_pages(big) <= 8 * HUGE_PAGE
    store = PagedKVStore(2, 512, 16, 4, 64, dtype=torch.bfloat16)  # 4 MiB a layer
    assert all(int(t.count_nonzero()) == 0 for t in store.k + store.v)
