"""A native step's plan and its outcome as plain values: the :class:`Scheduler` returns them and
the engine runs and reports them, so neither keeps state for the other to read. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.core.interface import TokenOutput
from tokenfleet.core.sequence import SeqState


@dataclass(frozen=True)
class PrefillBatch:
    """Sequences whose tokens go through the model for the first time (or again, resumed): each
    one's block table (enough blocks for every token), how many of its first tokens the cache
    holds already (``cached``: whole blocks, shared with other sequences) and the tokens after
    them, which the prefill computes."""

    seqs: list[SeqState]
    tables: list[list[int]]
    token_lists: list[list[int]]
    cached: list[int]

    @property
    def prompt_tokens(self) -> int:
        """Tokens the prefill computes (cached ones excluded)."""
        return sum(len(t) for t in self.token_lists)


@dataclass(frozen=True)
class DecodeBatch:
    """One new token for each running sequence: its table, its stored tokens (the newest, not yet
    in the cache, among them: its slot is allocated) and that newest token."""

    seqs: list[SeqState]
    tables: list[list[int]]
    lengths: list[int]
    last_tokens: list[int]


@dataclass(frozen=True)
class Scheduled:
    """A step's plan: the batch to run (None: nothing is due) and whom making room for it preempted."""

    batch: PrefillBatch | DecodeBatch | None
    preempted: list[SeqState] = field(default_factory=list)


@dataclass(frozen=True)
class Advanced:
    """What a batch's chosen tokens did: the tokens appended (finished sequences' last among them)
    and the rows that failed alone (no token could be chosen), already out of the scheduler."""

    tokens: list[TokenOutput]
    failed: list[tuple[SeqState, str]]
