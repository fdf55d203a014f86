"""The block allocator (pure: no torch, no Redis) on tiny pools with exact block ids: allocation,
growth, exhaustion as a value, misuse as an exception, prefix caching, and its integrity check."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.kvcache import BlockAllocator
from tokenfleet.kvcache.allocator import Allocation


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_allocate_hands_out_lowest_free_blocks_in_order():
    a = BlockAllocator(num_blocks=6, block_size=4, prefix_caching=True)
    assert a.allocate("x", tokens(5)) == Allocation([0, 1], 0)
    assert a.allocate("y", tokens(4, 200)) == Allocation([2], 0)
    assert a.num_free_blocks == 3 and a.num_used_blocks == 3
    assert a.slot("x", 4) == 1 * 4 + 0
    a.check_integrity()


def test_append_slot_grows_into_a_new_block_at_the_boundary():
    a = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=True)
    a.allocate("x", tokens(2))  # block 0 full
    assert a.append_slot("x", 7) == 1 * 2 + 0  # new block 1, offset 0
    assert a.append_slot("x", 8) == 1 * 2 + 1
    assert a.block_table("x") == [0, 1]
    assert a.num_tokens("x") == 4


def test_exhaustion_is_a_value_not_an_exception():
    a = BlockAllocator(num_blocks=2, block_size=2, prefix_caching=True)
    assert a.allocate("x", tokens(4)).table == [0, 1]
    assert not a.can_allocate(tokens(1, 500))
    assert a.allocate("y", tokens(1, 500)) is None
    assert a.append_slot("x", 9) is None  # full block, no free block
    assert a.num_tokens("x") == 4  # unchanged by the failed append
    a.check_integrity()


def test_freed_blocks_are_reused_unnamed_first_then_least_recently_used():
    a = BlockAllocator(num_blocks=5, block_size=2, prefix_caching=True)
    a.allocate("x", tokens(3))  # [0 (full: named), 1 (partial)]
    a.allocate("y", tokens(2, 200))  # [2 (named)]
    a.free("x")  # free list: 1 (unnamed, reused first), 3, 4, 0 (named, reused last)
    assert a.allocate("z", tokens(6, 300)).table == [1, 3, 4]
    assert a.allocate("w", tokens(2, 400)).table == [0]  # the pool needs it: its name goes
    assert a.num_cached_blocks == 5  # y's, z's three and w's full blocks
    a.check_integrity()


def test_without_prefix_caching_nothing_is_named_or_shared():
    a = BlockAllocator(num_blocks=6, block_size=2, prefix_caching=False)
    a.allocate("x", tokens(5))
    a.free("x")
    assert a.allocate("y", tokens(5)) == Allocation([0, 1, 2], 0)  # freed ones first, in order
    assert a.num_cached_blocks == 0 and a.queries == a.hits == 0
    a.check_integrity()


def test_can_allocate_respects_reserve_and_room_for_more_tokens():
    a = BlockAllocator(num_blocks=4, block_size=4, prefix_caching=True)
    assert a.can_allocate(tokens(8), reserve_blocks=1)  # two blocks, and room for a ninth token
    assert not a.can_allocate(tokens(8), reserve_blocks=2)
    assert a.can_allocate(tokens(8), reserve_blocks=2, extra_tokens=0)


def test_misuse_raises():
    a = BlockAllocator(num_blocks=4, block_size=4, prefix_caching=True)
    a.allocate("x", tokens(1))
    with pytest.raises(ValueError):
        a.allocate("x", tokens(1))
    with pytest.raises(ValueError):
        a.free("nobody")
    with pytest.raises(ValueError):
        a.append_slot("nobody", 1)
    with pytest.raises(ValueError):
        a.allocate("y", [])
    with pytest.raises(ValueError):
        BlockAllocator(0, 4, prefix_caching=True)


def test_integrity_check_catches_a_block_owned_twice_and_a_lost_block():
    a = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=True)
    a.allocate("x", tokens(2))
    a._tables["x"].append(next(iter(a._free)))  # owned and free at once
    with pytest.raises(RuntimeError):
        a.check_integrity()
    b = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=True)
    b._free.popitem()  # a block nobody owns
    with pytest.raises(RuntimeError):
        b.check_integrity()
    c = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=True)
    c.allocate("x", tokens(2))
    c._named.clear()  # a named block the map lost
    with pytest.raises(RuntimeError, match="names"):
        c.check_integrity()


# -- prefix caching ----------------------------------------------------------------------------


def test_a_prompt_reuses_the_cached_blocks_it_begins_with_and_computes_the_rest():
    a = BlockAllocator(num_blocks=10, block_size=4, prefix_caching=True)
    system = tokens(8)  # two full blocks
    assert a.allocate("x", system + [1, 2, 3]) == Allocation([0, 1, 2], 0)
    assert a.allocate("y", system + [4, 5]) == Allocation([0, 1, 3], 8)  # shared, then its own
    assert a.blocks_freed_by("y") == 1 and a.blocks_freed_by("x") == 1
    assert (a.queries, a.hits) == (21, 8)
    a.check_integrity()
    a.free("x")
    a.free("y")
    assert a.num_used_blocks == 0 and a.num_cached_blocks == 2
    assert a.allocate("z", system + [9]) == Allocation([0, 1, 3], 8)  # cached, held by no one
    a.check_integrity()


def test_the_last_token_is_always_computed_and_names_chain_from_the_first_block():
    a = BlockAllocator(num_blocks=10, block_size=4, prefix_caching=True)
    a.allocate("x", tokens(8))
    assert a.allocate("same", tokens(8)).cached_tokens == 4  # its logits need its last token
    assert a.allocate("shifted", [0] + tokens(8)).cached_tokens == 0  # same tokens, other positions
    assert a.allocate("other-start", tokens(4, 7) + tokens(4, 104)).cached_tokens == 0
    a.check_integrity()


def test_blocks_filled_by_decoding_are_named_too():
    a = BlockAllocator(num_blocks=10, block_size=2, prefix_caching=True)
    a.allocate("x", [1, 2, 3])
    a.append_slot("x", 4)  # fills the second block: [1 2] [3 4]
    a.append_slot("x", 5)
    a.free("x")
    assert a.allocate("turn-2", [1, 2, 3, 4, 5, 6]).cached_tokens == 4
    a.check_integrity()


def test_a_shared_block_stays_held_while_any_holder_runs():
    a = BlockAllocator(num_blocks=5, block_size=2, prefix_caching=True)
    a.allocate("x", [1, 2, 3])
    a.allocate("y", [1, 2, 4])
    a.free("x")
    assert a.num_used_blocks == 2  # y's own and the shared one
    assert a.allocate("z", tokens(4)).table == [1, 3]  # x's unnamed block, then a fresh one
    assert a.allocate("w", [1, 2, 5]).table[:1] == [0]  # the shared block, never handed out
    a.check_integrity()


def test_blocks_to_take_counts_cached_blocks_that_leave_the_free_list():
    a = BlockAllocator(num_blocks=6, block_size=2, prefix_caching=True)
    a.allocate("x", [1, 2, 3, 4, 5])
    a.free("x")  # [1 2] [3 4] cached, on the free list
    assert a.blocks_to_take([1, 2, 3, 4, 9]) == 3  # two cached come off the free list, one new
    a.allocate("y", [1, 2, 7])
    assert a.blocks_to_take([1, 2, 3, 4, 9], extra_tokens=1) == 2  # [1 2] is held by y already
    a.check_integrity()


def test_a_failed_step_forgets_the_names_of_blocks_it_was_to_fill():
    a = BlockAllocator(num_blocks=6, block_size=2, prefix_caching=True)
    a.allocate("x", [1, 2, 3, 4, 5])
    a.confirm()
    a.allocate("y", [1, 2, 3, 4, 6, 7, 8])  # names [6 7]; shares the rest
    a.forget_unconfirmed()  # the step that was to write [6 7] failed
    a.free("y")
    a.free("x")
    assert a.allocate("z", [1, 2, 3, 4, 6, 7, 9]).cached_tokens == 4  # not 6: [6 7] holds nothing
    a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=12)), max_size=40)
)
def test_any_sequence_of_operations_keeps_the_pool_consistent(operations):
    """Random allocations over a small alphabet (many shared prefixes), appends and frees on a
    small pool: the integrity check holds after every one, and a cached block is only reused for
    the very tokens it holds (checked against each sequence's own record)."""
    a = BlockAllocator(num_blocks=8, block_size=2, prefix_caching=True)
    contents: dict[int, tuple] = {}  # block -> the (position, tokens) written there
    live: dict[str, list[int]] = {}
    for n, (kind, toks) in enumerate(operations):
        if kind == 0 and live:  # free one
            key = sorted(live)[0]
            del live[key]
            a.free(key)
        elif kind == 1 and live:  # grow one
            key = sorted(live)[-1]
            if a.append_slot(key, toks[0]) is not None:
                live[key].append(toks[0])
                position = len(live[key]) - 1
                block = a.block_table(key)[position // 2]
                contents[block] = (*contents.get(block, ())[: position % 2], (position, toks[0]))
        else:
            key = f"s{n}"
            got = a.allocate(key, toks)
            if got is None:
                continue
            for i in range(got.cached_tokens):  # what a hit block holds is this sequence's prefix
                assert contents[got.table[i // 2]][i % 2] == (i, toks[i])
            for i in range(got.cached_tokens, len(toks)):
                block = got.table[i // 2]
                contents[block] = (*contents.get(block, ())[: i % 2], (i, toks[i]))
            live[key] = list(toks)
        a.check_integrity()


def test_a_first_block_filled_while_decoding_keeps_its_adapters_salt():
    """A prompt shorter than a block, under an adapter's salt, decodes past the block: the block it
    fills is named under that salt, never found by the base model or another adapter."""
    a = BlockAllocator(num_blocks=8, block_size=4, prefix_caching=True)
    assert a.allocate("adapted", [1, 2], salt=b"adapter:support") is not None
    for token in (3, 4, 5):
        assert a.append_slot("adapted", token) is not None
    a.confirm()
    a.free("adapted")
    assert a.cached_prefix([1, 2, 3, 4, 5, 6]) == []
    assert a.cached_prefix([1, 2, 3, 4, 5, 6], b"adapter:legal") == []
    assert len(a.cached_prefix([1, 2, 3, 4, 5, 6], b"adapter:support")) == 1
