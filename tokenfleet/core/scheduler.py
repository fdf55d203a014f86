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

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.batches import Advanced, DecodeBatch, PrefillBatch, Scheduled
from tokenfleet.core.interface import Capacity, TokenOutput
from tokenfleet.core.lanes import PreemptedQueue, pick_victim, victims_for
from tokenfleet.core.sequence import SeqState
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import TokenLogprob

log = logging.getLogger(__name__)

Joiner = tuple[SeqState, int]  # a sequence about to prefill, and the tokens the cache holds for it


class Scheduler:
    """Batching, KV blocks and preemption for the native engine core."""

    def __init__(self, batcher: Batcher, config: DynamicBatchingConfig, kv: KVCacheConfig, num_blocks: int):
        """Schedules ``batcher``'s requests under ``config`` over a pool of ``num_blocks`` blocks
        laid out as ``kv`` says; the block allocator is the scheduler's alone."""
        self.allocator = BlockAllocator(num_blocks, kv.block_size, kv.prefix_caching)
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

    @property
    def num_waiting(self) -> int:
        """Read from Redis, not yet started: queued or preempted."""
        return len(self.batcher) + len(self.preempted)

    def capacity(self, bytes_per_block: int) -> Capacity:
        alloc = self.allocator
        return Capacity(
            max_seq_len=self.config.max_seq_len,
            block_size=alloc.block_size,
            kv_blocks_total=alloc.num_blocks,
            kv_blocks_used=alloc.num_used_blocks,
            running=len(self.running),
            waiting=self.num_waiting,
            kv_bytes_per_block=bytes_per_block,
            prefix_cache_queries=alloc.queries,
            prefix_cache_hits=alloc.hits,
        )

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
        cached = self.allocator.cached_prefix(tokens, seq.cache_salt)
        return len(tokens) - len(cached) * self.allocator.block_size

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
        salt = seq.cache_salt
        if not alloc.can_allocate(tokens, reserve_blocks=len(self.running) + admitted_now, salt=salt):
            if self.config.mode != "continuous":
                return None
            victims = victims_for(alloc, self.running, seq, admitted_now)
            if not victims:
                return None
            for victim in victims:
                preempted.append(self._preempt(victim, "for a request of a higher lane"))
        allocation = alloc.allocate(seq.key, tokens, salt)
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

    def ran(self) -> None:
        """The step's forward pass wrote the K/V of the blocks this schedule named: their cached
        names now hold."""
        self.allocator.confirm()

    def failed_to_run(self) -> None:
        """The step's forward pass failed: the blocks it was to fill hold no K/V, so they lose the
        names a later prompt would have found them by."""
        self.allocator.forget_unconfirmed()

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

    def check_idle(self) -> None:
        """The allocator's integrity, and no block in use once no sequence is held."""
        self.allocator.check_integrity()
        held = self.running or self.preempted or len(self.batcher)
        if not held and self.allocator.num_used_blocks:
            raise RuntimeError(f"{self.allocator.num_used_blocks} KV blocks in use with no sequence held")

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove these sequences wherever they are (running, preempted, waiting), freeing their
        blocks; used for cancellation, deadlines and failed steps."""
        dropped = [s for s in self.running if s.key in keys]
        for seq in dropped:
            self._release(seq)
        gone = self.preempted.drop(keys)
        waiting = [item.payload for item in self.batcher.remove(lambda item: item.key in keys)]
        return dropped + gone + waiting
