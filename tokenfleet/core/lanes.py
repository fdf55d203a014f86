"""Priority lanes inside the core: whom to preempt when the KV pool is full, and the order the
preempted resume in. Pure: the allocator's counts in, sequences out."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Hashable

from tokenfleet.core.sequence import SeqState
from tokenfleet.kvcache.allocator import BlockAllocator


def pick_victim(running: list[SeqState], below: int | None = None) -> SeqState | None:
    """The running sequence to preempt: of the lowest lane (lower than ``below``, when given), the
    youngest of those (``running`` is in admission order)."""
    order = {id(s): i for i, s in enumerate(running)}
    candidates = [s for s in running if below is None or s.request.lane > below]
    return max(candidates, key=lambda s: (s.request.lane, order[id(s)]), default=None)


def victims_for(
    alloc: BlockAllocator, running: list[SeqState], seq: SeqState, admitted_now: int
) -> list[SeqState]:
    """The lower-lane sequences whose preemption makes room for ``seq`` (lowest lane and youngest
    first), or none when even all of them would not: never preempt for nothing. A victim frees
    only the blocks no other sequence shares."""
    needed = alloc.blocks_to_take(seq.all_tokens, extra_tokens=1, salt=seq.cache_salt)
    lower = [s for s in running if s.request.lane > seq.request.lane]
    reserve = len(running) + admitted_now
    chosen: list[SeqState] = []
    free = alloc.num_free_blocks
    while not free >= needed + reserve - len(chosen):
        victim = pick_victim(lower)
        if victim is None:
            return []
        lower.remove(victim)
        chosen.append(victim)
        free += alloc.blocks_freed_by(victim.key)
    return chosen


class PreemptedQueue(deque[SeqState]):
    """Preempted sequences waiting to resume: higher lanes first, each lane in preemption order."""

    def add(self, seq: SeqState) -> None:
        lane = seq.request.lane
        self.insert(next((i for i, s in enumerate(self) if s.request.lane > lane), len(self)), seq)

    def in_lane(self, lane: int) -> int:
        return sum(s.request.lane == lane for s in self)

    def drop(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove and return the sequences with these keys."""
        gone = [s for s in self if s.key in keys]
        for seq in gone:
            self.remove(seq)
        return gone
