"""The native engine's scheduler: who runs in the next forward pass, and what their tokens change.

:meth:`Scheduler.schedule` returns the step's batch as plain values (a :class:`PrefillBatch` of
newly started or resumed sequences, or a :class:`DecodeBatch` of every running one) with the
sequences it preempted to make room; the engine runs the batch and hands the chosen tokens to
:meth:`Scheduler.postprocess`, which returns what they produced. Static and dynamic modes run a
batch to completion; continuous mode lets waiting requests join at the next step, with a decode
step between two joins. The scheduler owns the block allocator. Pure: no torch, no Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.interface import TokenOutput
from tokenfleet.core.lanes import PreemptedQueue, pick_victim, victims_for
from tokenfleet.core.sequence import SeqState
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import TokenLogprob

log = logging.getLogger(__name__)

Joiner = tuple[SeqState, int]  # a sequence about to prefill, and the tokens the cache holds for it


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


class Scheduler:
    """Batching, KV blocks and preemption for the native engine core."""

    def __init__(self, allocator: BlockAllocator, batcher: Batcher, config: DynamicBatchingConfig):
        self.allocator = allocator
        self.batcher = batcher
        self.config = config
        self.running: list[SeqState] = []  # in admission order: the last is the youngest
        self.preempted = PreemptedQueue()
        self.preemptions = 0
        self._prefilled_last_step = False

    @property
    def has_work(self) -> bool:
        """A step would run something now."""
        return bool(self.running or self.preempted) or self.batcher.is_due()

    # -- scheduling -----------------------------------------------------------------------------

    def schedule(self, flush: bool = False) -> Scheduled:
        """The next forward pass. ``flush`` starts waiting requests without waiting for their
        batch to be due (shutdown)."""
        preempted: list[SeqState] = []
        # Joiners prefill between decode steps, never two prefills in a row: requests arriving
        # steadily would otherwise stall every running sequence for prefill after prefill
        if self.running and self.config.mode == "continuous" and not self._prefilled_last_step:
            joiners = self._joiners(self.config.max_batch_size - len(self.running), preempted)
            if joiners:
                return Scheduled(self._prefill_batch(joiners), preempted)
        if self.running:
            return Scheduled(self._decode_batch(preempted), preempted)
        joiners = self._joiners(self.config.max_batch_size, preempted, dispatch=not flush)
        return Scheduled(self._prefill_batch(joiners) if joiners else None, preempted)

    def _joiners(self, slots: int, preempted: list[SeqState], dispatch: bool = False) -> list[Joiner]:
        """Sequences to prefill now, their blocks allocated, with the tokens the cache holds for
        each. Preempted ones resume before anything new; new ones are dispatched by the batching
        rule when the worker is idle, or taken at once to join a running batch (continuous).
        Those the pool cannot hold yet go back to the queue."""
        if slots <= 0:
            return []
        chosen: list[Joiner] = []
        budget = self._prefill_budget()
        if self.preempted and self._resumes_first():
            while self.preempted and len(chosen) < slots:
                head = self.preempted[0]
                tokens = self._to_compute(head)
                if chosen and tokens > budget:
                    break
                cached = self._allocate(head, len(chosen), preempted)
                if cached is None:
                    break
                chosen.append((self.preempted.popleft(), cached))
                budget -= tokens
            return self._started(chosen)
        batch = self.batcher.next_batch(slots) if dispatch else self.batcher.take(slots)
        if batch is None:
            return []
        unplaced: list[PendingRequest] = []
        for item in batch.items:
            tokens = self._to_compute(item.payload)
            fits = not chosen or tokens <= budget
            cached = self._allocate(item.payload, len(chosen), preempted) if not unplaced and fits else None
            if cached is None:
                unplaced.append(item)
                continue
            chosen.append((item.payload, cached))
            budget -= tokens
        if unplaced:
            self.batcher.requeue(unplaced)
        return self._started(chosen)

    def _to_compute(self, seq: SeqState) -> int:
        """Tokens a prefill of ``seq`` would compute now: those the cache does not hold."""
        tokens = seq.all_tokens
        return len(tokens) - len(self.allocator.cached_prefix(tokens)) * self.allocator.block_size

    def _resumes_first(self) -> bool:
        """Whether the first preempted sequence goes before every new request (its lane ranks
        at least as high as theirs)."""
        best_new = self.batcher.best_rank()
        return best_new is None or self.preempted[0].request.lane <= best_new

    def _prefill_budget(self) -> float:
        """Prompt tokens this step's prefill may take: ``max_prefill_tokens`` in continuous mode
        (the rest start after a decode step); unbounded in static and dynamic mode, whose batches
        start together and run to completion."""
        if self.config.mode == "continuous":
            return self.config.max_prefill_tokens
        return float("inf")

    def _allocate(self, seq: SeqState, admitted_now: int, preempted: list[SeqState]) -> int | None:
        """Give ``seq`` blocks for all its tokens (the cached blocks it begins with, shared, and new
        ones) if that leaves one block in reserve per running sequence (so decode can grow before
        anyone is preempted); returns how many of its tokens the cache holds, None: no room. In
        continuous mode, when the pool is full, running sequences of lower lanes are preempted
        for it if that makes room."""
        alloc = self.allocator
        tokens = seq.all_tokens
        if not alloc.can_allocate(tokens, reserve_blocks=len(self.running) + admitted_now):
            if self.config.mode != "continuous":
                return None
            victims = victims_for(alloc, self.running, seq, admitted_now)
            if not victims:
                return None
            for victim in victims:
                preempted.append(self._preempt(victim, "for a request of a higher lane"))
        allocation = alloc.allocate(seq.key, tokens)
        return None if allocation is None else allocation.cached_tokens

    def _started(self, chosen: list[Joiner]) -> list[Joiner]:
        for seq, cached in chosen:
            if seq.started is None:
                seq.started = time.time()
                seq.batch_size = len(chosen) + len(self.running)
                seq.cached_tokens = cached
        return chosen

    def _prefill_batch(self, chosen: list[Joiner]) -> PrefillBatch:
        self._prefilled_last_step = True
        seqs = [seq for seq, _ in chosen]
        self.running.extend(seqs)
        tables = [self.allocator.block_table(s.key) for s in seqs]
        tails = [seq.all_tokens[cached:] for seq, cached in chosen]
        return PrefillBatch(seqs, tables, tails, [cached for _, cached in chosen])

    def _decode_batch(self, preempted: list[SeqState]) -> DecodeBatch | None:
        self._prefilled_last_step = False
        self._reserve_slots(preempted)
        seqs = list(self.running)
        if not seqs:
            return None
        alloc = self.allocator
        return DecodeBatch(
            seqs,
            [alloc.block_table(s.key) for s in seqs],
            [alloc.num_tokens(s.key) for s in seqs],
            [s.generated[-1] for s in seqs],
        )

    def _reserve_slots(self, preempted: list[SeqState]) -> None:
        """Append one KV slot per running sequence; when the pool is dry, preempt the youngest
        running sequence of the lowest lane (its blocks freed, recomputed later) and try again."""
        alloc = self.allocator
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if alloc.append_slot(seq.key, seq.generated[-1]) is not None:
                i += 1
                continue
            victim = pick_victim(self.running)
            assert victim is not None
            if self.running.index(victim) < i:
                i -= 1  # its new slot is freed with the rest of its blocks
            preempted.append(self._preempt(victim, "KV pool full"))

    def _preempt(self, victim: SeqState, why: str) -> SeqState:
        """Free ``victim``'s blocks; it resumes later (recomputed), before new requests of its lane."""
        self.running.remove(victim)
        self.allocator.free(victim.key)
        victim.preemptions += 1
        self.preemptions += 1
        self.preempted.add(victim)
        log.info("%s: preempted %s after %d tokens", why, victim.request.id, len(victim.generated))
        return victim

    # -- after the forward pass -----------------------------------------------------------------

    def postprocess(
        self,
        batch: PrefillBatch | DecodeBatch,
        tokens: list[int | None],
        logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> Advanced:
        """Append each sequence's token (with its logprobs, where asked); finished sequences
        leave, their blocks freed; a row without a token (it could not be sampled) leaves as
        failed."""
        if isinstance(batch, DecodeBatch):
            for seq in batch.seqs:
                seq.decode_steps += 1
                seq.batch_size_sum += len(batch.seqs)
        outputs, failed = [], []
        for row, (seq, token) in enumerate(zip(batch.seqs, tokens)):
            if token is None:
                self._release(seq)
                failed.append((seq, seq.sampling_error or "no token was chosen"))
                continue
            outputs.append(TokenOutput.append(seq, token, logprobs[row] if logprobs else None))
            if seq.finished:
                self._release(seq)
        return Advanced(outputs, failed)

    def _release(self, seq: SeqState) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.key)

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove these sequences wherever they are (running, preempted, waiting), freeing their
        blocks; used for cancellation, deadlines and failed steps."""
        dropped = [s for s in self.running if s.key in keys]
        for seq in dropped:
            self._release(seq)
        gone = self.preempted.drop(keys)
        waiting = [item.payload for item in self.batcher.remove(lambda item: item.key in keys)]
        return dropped + gone + waiting
