"""The native engine core: admission, prefill, decode and preemption over our model runner.

One :meth:`Scheduler.step` is one forward pass: a prefill of newly dispatched (or resumed)
sequences, or a decode step of every running sequence. Static and dynamic modes run a batch to
completion; continuous mode lets waiting requests join at the next step, with a decode step
between two joins. The scheduler owns the block allocator. No Redis here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Hashable

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Admission, Limits
from tokenfleet.core.interface import BatchEvent, Capacity, MemoryStats, Runner, StepOutput, TokenOutput
from tokenfleet.core.lanes import PreemptedQueue, pick_victim, victims_for
from tokenfleet.core.sequence import SeqState
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import Refusal

log = logging.getLogger(__name__)


class Scheduler:
    """The native :class:`~tokenfleet.core.interface.EngineCore`."""

    backend = "native"

    def __init__(
        self,
        runner: Runner,
        batching: DynamicBatchingConfig,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[BatchEvent], None] | None = None,
    ):
        self.runner = runner
        self.config = batching
        self.clock = clock
        self.facts = runner.facts()
        self.allocator = BlockAllocator(runner.num_blocks, runner.block_size)
        self.admission = Admission(
            Limits(
                buckets=batching.buckets,
                max_seq_len=batching.max_seq_len,
                max_new_tokens_cap=batching.max_new_tokens_cap,
                vocab_size=self.facts.vocab_size,
                max_token_chars=self.facts.max_token_chars,
                kv_tokens_per_seq=runner.num_blocks * runner.block_size,
            )
        )
        self.batcher = Batcher(batching, clock)
        self._running: list[SeqState] = []  # in admission order: the last is the youngest
        self.preempted = PreemptedQueue()
        self.on_batch = on_batch
        self.preemptions = 0
        self.peak = self.memory_stats()  # pool use at its fullest so far
        self._prefilled_last_step = False
        self._step_output = StepOutput()

    # -- intake ---------------------------------------------------------------------------------

    def add(self, seq: SeqState, arrived: float) -> Refusal | None:
        """Queue a sequence; a :class:`Refusal` if it can never run on this worker."""
        return self.admission.queue(seq, arrived, self.batcher)

    def held(self) -> list[SeqState]:
        """Every sequence this scheduler holds: running, preempted and waiting."""
        return [*self._running, *self.preempted, *(item.payload for item in self.batcher.pending())]

    def running(self) -> list[SeqState]:
        return [*self._running, *self.preempted]

    @property
    def num_waiting(self) -> int:
        """Read from Redis, not yet started (the no-hoarding bound applies to this)."""
        return len(self.batcher) + len(self.preempted)

    def waiting_in(self, lane: int) -> int:
        return self.batcher.waiting_in(lane) + self.preempted.in_lane(lane)

    @property
    def has_work(self) -> bool:
        """A step would run something now."""
        return bool(self._running or self.preempted) or self.batcher.is_due()

    def ready_at(self) -> float | None:
        """When an idle scheduler will next have a batch due (see :meth:`Batcher.ready_at`)."""
        return self.batcher.ready_at()

    def capacity(self) -> Capacity:
        return Capacity(
            max_seq_len=self.config.max_seq_len,
            block_size=self.allocator.block_size,
            kv_blocks_total=self.allocator.num_blocks,
            kv_blocks_used=self.allocator.num_used_blocks,
            running=len(self._running),
            waiting=self.num_waiting,
            kv_bytes_per_block=self.runner.bytes_per_block,
        )

    def memory_stats(self) -> MemoryStats:
        return MemoryStats.of(self.allocator, self.runner.bytes_per_block)

    def check_idle(self) -> None:
        self.allocator.check_integrity()
        if not self.held() and self.allocator.num_used_blocks:
            raise RuntimeError(f"{self.allocator.num_used_blocks} KV blocks in use with no sequence held")

    def close(self) -> None:
        pass

    # -- stepping -------------------------------------------------------------------------------

    def step(self, flush: bool = False) -> StepOutput:
        """Run one forward pass if any is due; returns the tokens it produced. ``flush`` starts
        waiting requests without waiting for their batch to be due (shutdown)."""
        self._step_output = out = StepOutput()
        out.tokens = self._step(flush)
        if self.allocator.num_used_blocks > self.peak.blocks_used:
            self.peak = self.memory_stats()
        return out

    def _step(self, flush: bool) -> list[TokenOutput]:
        # Joiners prefill between decode steps, never two prefills in a row: requests arriving
        # steadily would otherwise stall every running sequence for prefill after prefill
        if self._running and self.config.mode == "continuous" and not self._prefilled_last_step:
            joiners = self._joiners(self.config.max_batch_size - len(self._running))
            if joiners:
                return self._prefill(joiners)
        if self._running:
            return self._decode()
        joiners = self._joiners(self.config.max_batch_size, dispatch=not flush)
        return self._prefill(joiners) if joiners else []

    def _joiners(self, slots: int, dispatch: bool = False) -> list[SeqState]:
        """Sequences to prefill now, their blocks allocated. Preempted ones resume before anything
        new; new ones are dispatched by the batching rule when the worker is idle, or taken at once
        to join a running batch (continuous). Those the pool cannot hold yet go back to the queue."""
        if slots <= 0:
            return []
        chosen: list[SeqState] = []
        if self.preempted and self._resumes_first():
            budget = self._prefill_budget()
            while self.preempted and len(chosen) < slots:
                tokens = len(self.preempted[0].all_tokens)
                if (chosen and tokens > budget) or not self._allocate(self.preempted[0], len(chosen)):
                    break
                chosen.append(self.preempted.popleft())
                budget -= tokens
            return self._started(chosen)
        batch = self.batcher.next_batch(slots) if dispatch else self.batcher.take(slots)
        if batch is None:
            return []
        unplaced: list[PendingRequest] = []
        budget = self._prefill_budget()
        for item in batch.items:
            tokens = len(item.payload.all_tokens)
            fits = not chosen or tokens <= budget
            if not unplaced and fits and self._allocate(item.payload, len(chosen)):
                chosen.append(item.payload)
                budget -= tokens
            else:
                unplaced.append(item)
        if unplaced:
            self.batcher.requeue(unplaced)
        return self._started(chosen)

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

    def _allocate(self, seq: SeqState, admitted_now: int) -> bool:
        """Give ``seq`` blocks for all its tokens if that leaves one block in reserve per running
        sequence (so decode can grow before anyone is preempted). In continuous mode, when the
        pool is full, running sequences of lower lanes are preempted for it if that makes room."""
        alloc = self.allocator
        tokens = len(seq.all_tokens)
        if not alloc.can_allocate(tokens + 1, reserve_blocks=len(self._running) + admitted_now):
            if self.config.mode != "continuous":
                return False
            victims = victims_for(alloc, self._running, seq, admitted_now)
            if not victims:
                return False
            for victim in victims:
                self._preempt(victim, "for a request of a higher lane")
        return alloc.allocate(seq.key, tokens) is not None

    def _started(self, seqs: list[SeqState]) -> list[SeqState]:
        for seq in seqs:
            if seq.started is None:
                seq.started = time.time()
                seq.batch_size = len(seqs) + len(self._running)
        return seqs

    def _prefill(self, seqs: list[SeqState]) -> list[TokenOutput]:
        self._prefilled_last_step = True
        token_lists = [s.all_tokens for s in seqs]
        logits = self.runner.prefill([self.allocator.block_table(s.key) for s in seqs], token_lists)
        real, computed = sum(len(t) for t in token_lists), self.runner.last_prefill_tokens
        self._emit(
            BatchEvent(
                "prefill",
                len(seqs),
                computed,
                self.runner.last_prefill_forwards,
                (computed - real) / real,
                prompt_tokens=real,
            )
        )
        self._running.extend(seqs)
        return self._advance(seqs, self.runner.choose_tokens(logits, seqs))

    def _decode(self) -> list[TokenOutput]:
        self._prefilled_last_step = False
        self._reserve_slots()
        seqs = list(self._running)
        if not seqs:
            return []
        self._emit(BatchEvent("decode", len(seqs)))
        alloc = self.allocator
        logits = self.runner.decode(
            [alloc.block_table(s.key) for s in seqs],
            [alloc.num_tokens(s.key) for s in seqs],
            [s.generated[-1] for s in seqs],
        )
        for s in seqs:
            s.decode_steps += 1
            s.batch_size_sum += len(seqs)
        return self._advance(seqs, self.runner.choose_tokens(logits, seqs))

    def _reserve_slots(self) -> None:
        """Append one KV slot per running sequence; when the pool is dry, preempt the youngest
        running sequence of the lowest lane (its blocks freed, recomputed later) and try again."""
        alloc = self.allocator
        i = 0
        while i < len(self._running):
            if alloc.append_slot(self._running[i].key) is not None:
                i += 1
                continue
            victim = pick_victim(self._running)
            assert victim is not None
            if self._running.index(victim) < i:
                i -= 1  # its new slot is freed with the rest of its blocks
            self._preempt(victim, "KV pool full")

    def _preempt(self, victim: SeqState, why: str) -> None:
        """Free ``victim``'s blocks; it resumes later (recomputed), before new requests of its lane."""
        self._running.remove(victim)
        self.allocator.free(victim.key)
        victim.preemptions += 1
        self.preemptions += 1
        self.preempted.add(victim)
        self._step_output.preempted.append(victim)
        log.info("%s: preempted %s after %d tokens", why, victim.request.id, len(victim.generated))

    def _advance(self, seqs: list[SeqState], tokens: list[int | None]) -> list[TokenOutput]:
        """Append each sequence's token; a row without one (it could not be sampled) leaves the
        batch as failed, its blocks freed."""
        outputs = []
        for seq, token in zip(seqs, tokens):
            if token is None:
                self._release(seq)
                self._step_output.failed.append((seq, seq.sampling_error or "no token was chosen"))
                continue
            outputs.append(TokenOutput.append(seq, token))
            if seq.finished:
                self._release(seq)
        return outputs

    def _release(self, seq: SeqState) -> None:
        self._running.remove(seq)
        self.allocator.free(seq.key)

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove these sequences wherever they are (running, preempted, waiting), freeing their
        blocks; used for cancellation, deadlines and failed steps."""
        dropped = [s for s in self._running if s.key in keys]
        for seq in dropped:
            self._release(seq)
        gone = self.preempted.drop(keys)
        waiting = [item.payload for item in self.batcher.remove(lambda item: item.key in keys)]
        return dropped + gone + waiting

    def _emit(self, event: BatchEvent) -> None:
        self._step_output.batches.append(event)
        if self.on_batch is not None:
            self.on_batch(event)
