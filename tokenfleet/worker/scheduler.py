"""Iteration-level scheduling over the engine: admission, prefill, decode, preemption.

One :meth:`Scheduler.step` is one forward pass: a prefill of newly dispatched (or resumed)
sequences, or a decode step of every running sequence. Static and dynamic modes run a batch to
completion before dispatching the next; continuous mode lets waiting requests join at the next
step, with at least one decode step between two joins. No Redis here: the worker loop feeds
requests in and publishes what a step returns.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenfleet.batcher import Batcher, PendingRequest, Rejection
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.protocol import ErrorCode
from tokenfleet.worker.engine import Engine
from tokenfleet.worker.sampling import choose_tokens
from tokenfleet.worker.sequence import SeqState

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced for one sequence: a token to stream, and maybe the end."""

    seq: SeqState
    index: int  # position of ``token_id`` among the generated tokens
    token_id: int
    text: str

    @property
    def finished(self) -> bool:
        return self.seq.finished


@dataclass(frozen=True)
class BatchEvent:
    """A forward pass the scheduler ran, for logs, metrics and the demo."""

    kind: str  # "prefill" or "decode"
    size: int
    computed_tokens: int = 0  # prefill: tokens the forwards ran, padding included
    forwards: int = 1
    padding_waste: float = 0.0  # prefill: padding tokens / prompt tokens
    prompt_tokens: int = 0  # prefill: the prompts' own tokens (what max_prefill_tokens bounds)


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        batching: DynamicBatchingConfig,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[BatchEvent], None] | None = None,
    ):
        self.engine = engine
        self.config = batching
        self.clock = clock
        self.batcher = Batcher(batching, clock)
        self.running: list[SeqState] = []  # in admission order: the last is the youngest
        self.preempted: deque[SeqState] = deque()
        self.on_batch = on_batch
        self.preemptions = 0
        self.peak = engine.memory_stats()  # pool use at its fullest since the last reset_peak()
        self._prefilled_last_step = False

    # -- intake ---------------------------------------------------------------------------------

    def add(self, seq: SeqState, arrived: float) -> Rejection | None:
        """Queue a sequence; a :class:`Rejection` if it can never run on this worker."""
        prompt_len, max_new = len(seq.prompt_ids), seq.request.max_new_tokens
        alloc = self.engine.allocator
        if alloc.blocks_needed(prompt_len + max_new) > alloc.num_blocks:
            return Rejection(
                ErrorCode.CACHE_TOO_SMALL,
                f"prompt ({prompt_len}) + max_new_tokens ({max_new}) needs "
                f"{alloc.blocks_needed(prompt_len + max_new)} KV blocks; this worker has {alloc.num_blocks}",
            )
        return self.batcher.add(PendingRequest(seq.key, prompt_len, max_new, arrived, payload=seq))

    def held(self) -> list[SeqState]:
        """Every sequence this scheduler holds: running, preempted and waiting."""
        return [*self.running, *self.preempted, *(item.payload for item in self.batcher.pending())]

    @property
    def num_waiting(self) -> int:
        """Read from Redis, not yet started (the no-hoarding bound applies to this)."""
        return len(self.batcher) + len(self.preempted)

    @property
    def busy(self) -> bool:
        """A step would run something now."""
        return bool(self.running or self.preempted) or self.batcher.is_due()

    def ready_at(self) -> float | None:
        """When an idle scheduler will next have a batch due (see :meth:`Batcher.ready_at`)."""
        return self.batcher.ready_at()

    # -- stepping -------------------------------------------------------------------------------

    def step(self, flush: bool = False) -> list[StepOutput]:
        """Run one forward pass if any is due; returns the tokens it produced. ``flush`` starts
        waiting requests without waiting for their batch to be due (shutdown)."""
        outputs = self._step(flush)
        if self.engine.allocator.num_used_blocks > self.peak.blocks_used:
            self.peak = self.engine.memory_stats()
        return outputs

    def reset_peak(self) -> None:
        self.peak = self.engine.memory_stats()

    def _step(self, flush: bool) -> list[StepOutput]:
        # Joiners prefill between decode steps, never two prefills in a row: requests arriving
        # steadily would otherwise stall every running sequence for prefill after prefill
        if self.running and self.config.mode == "continuous" and not self._prefilled_last_step:
            joiners = self._joiners(self.config.max_batch_size - len(self.running))
            if joiners:
                return self._prefill(joiners)
        if self.running:
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
        if self.preempted:
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

    def _prefill_budget(self) -> float:
        """Prompt tokens this step's prefill may take: ``max_prefill_tokens`` in continuous mode
        (the rest start after a decode step); unbounded in static and dynamic mode, whose batches
        start together and run to completion."""
        if self.config.mode == "continuous":
            return self.config.max_prefill_tokens
        return float("inf")

    def _allocate(self, seq: SeqState, admitted_now: int) -> bool:
        """Give ``seq`` blocks for all its tokens if that leaves one block in reserve per running
        sequence (so decode can grow before anyone is preempted)."""
        alloc = self.engine.allocator
        tokens = len(seq.all_tokens)
        if not alloc.can_allocate(tokens + 1, reserve_blocks=len(self.running) + admitted_now):
            return False
        return alloc.allocate(seq.key, tokens) is not None

    def _started(self, seqs: list[SeqState]) -> list[SeqState]:
        for seq in seqs:
            seq.init_generator(self.engine.device)
            if seq.started is None:
                seq.started = time.time()
                seq.batch_size = len(seqs) + len(self.running)
        return seqs

    def _prefill(self, seqs: list[SeqState]) -> list[StepOutput]:
        self._prefilled_last_step = True
        token_lists = [s.all_tokens for s in seqs]
        logits = self.engine.prefill([s.key for s in seqs], token_lists)
        real, computed = sum(len(t) for t in token_lists), self.engine.last_prefill_tokens
        self._emit(
            BatchEvent(
                "prefill",
                len(seqs),
                computed,
                self.engine.last_prefill_forwards,
                (computed - real) / real,
                prompt_tokens=real,
            )
        )
        self.running.extend(seqs)
        return self._advance(seqs, choose_tokens(logits, seqs))

    def _decode(self) -> list[StepOutput]:
        self._prefilled_last_step = False
        self._reserve_slots()
        seqs = list(self.running)
        if not seqs:
            return []
        self._emit(BatchEvent("decode", len(seqs)))
        logits = self.engine.decode([s.key for s in seqs], [s.generated[-1] for s in seqs])
        for s in seqs:
            s.decode_steps += 1
            s.batch_size_sum += len(seqs)
        return self._advance(seqs, choose_tokens(logits, seqs))

    def _reserve_slots(self) -> None:
        """Append one KV slot per running sequence; when the pool is dry, preempt the youngest
        running sequence (its blocks freed, recomputed later) and try again."""
        alloc = self.engine.allocator
        i = 0
        while i < len(self.running):
            if alloc.append_slot(self.running[i].key) is not None:
                i += 1
                continue
            victim = self.running.pop()
            alloc.free(victim.key)
            victim.preemptions += 1
            self.preemptions += 1
            self.preempted.append(victim)
            log.info("KV pool full: preempted %s after %d tokens", victim.request.id, len(victim.generated))

    def _advance(self, seqs: list[SeqState], tokens: list[int]) -> list[StepOutput]:
        outputs = []
        for seq, token in zip(seqs, tokens):
            seq.append(token)
            outputs.append(StepOutput(seq, len(seq.generated) - 1, token, seq.take_text_delta()))
            if seq.finished:
                self._release(seq)
        return outputs

    def _release(self, seq: SeqState) -> None:
        self.running.remove(seq)
        self.engine.allocator.free(seq.key)

    def drop(self, predicate: Callable[[SeqState], bool]) -> list[SeqState]:
        """Remove matching sequences wherever they are (running, preempted, waiting), freeing
        their blocks; used for cancellation, deadlines and failed steps."""
        dropped = [s for s in self.running if predicate(s)]
        for seq in dropped:
            self._release(seq)
        gone = [s for s in self.preempted if predicate(s)]
        self.preempted = deque(s for s in self.preempted if not predicate(s))
        waiting = [item.payload for item in self.batcher.remove(lambda item: predicate(item.payload))]
        return dropped + gone + waiting

    def _emit(self, event: BatchEvent) -> None:
        if self.on_batch is not None:
            self.on_batch(event)
