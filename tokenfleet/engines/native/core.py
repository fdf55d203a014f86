"""The native engine core: our scheduler and our model runner behind the core's interface.

A step is a pipeline of values, as in nano-vllm's engine: the scheduler says what runs
(:meth:`Scheduler.schedule`), the runner computes its logits (and, for a prefill, what it
computed), the runner's sampler picks the tokens, and the scheduler says what they did
(:meth:`Scheduler.postprocess`). No Redis here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Limits
from tokenfleet.core.batches import DecodeBatch, PrefillBatch
from tokenfleet.core.front import CoreFront
from tokenfleet.core.interface import BatchEvent, Capacity, StepOutput
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.types import PrefillResult, Runner


class NativeCore(CoreFront):
    """The ``native`` :class:`~tokenfleet.core.interface.EngineCore`."""

    backend = "native"

    def __init__(
        self,
        runner: Runner,
        batching: DynamicBatchingConfig,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Admission and scheduling by ``batching`` over ``runner``'s model and KV pool (laid out
        and cached as ``runner.kv`` says)."""
        facts = runner.facts()
        limits = Limits(
            buckets=batching.buckets,
            max_seq_len=batching.max_seq_len,
            max_new_tokens_cap=batching.max_new_tokens_cap,
            vocab_size=facts.vocab_size,
            max_token_chars=facts.max_token_chars,
            kv_tokens_per_seq=runner.num_blocks * runner.kv.block_size,
        )
        super().__init__(facts, limits, batching, clock)
        self.runner = runner
        self.scheduler = Scheduler(self.batcher, batching, runner.kv, runner.num_blocks)

    # -- what it holds --------------------------------------------------------------------------

    def held(self) -> list[SeqState]:
        """Every sequence this core holds: running, preempted and waiting."""
        return [*self.running(), *self.waiting()]

    def running(self) -> list[SeqState]:
        return [*self.scheduler.running, *self.scheduler.preempted]

    @property
    def num_waiting(self) -> int:
        """Read from Redis, not yet started (the no-hoarding bound applies to this)."""
        return self.scheduler.num_waiting

    def waiting_in(self, lane: int) -> int:
        return self.batcher.waiting_in(lane) + self.scheduler.preempted.in_lane(lane)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def capacity(self) -> Capacity:
        return self.scheduler.capacity(self.runner.bytes_per_block)

    def check_idle(self) -> None:
        self.scheduler.check_idle()

    def close(self) -> None:
        pass

    # -- stepping -------------------------------------------------------------------------------

    def step(self, flush: bool = False) -> StepOutput:
        """Run one forward pass if any is due; returns what it produced. ``flush`` starts waiting
        requests without waiting for their batch to be due (shutdown)."""
        scheduled = self.scheduler.schedule(flush)
        batch = scheduled.batch
        if batch is None:
            return StepOutput(preempted=scheduled.preempted)
        masks = self.runner.start_masks(batch.seqs)  # grammar masks fill while the model runs
        try:
            match batch:
                case PrefillBatch():
                    result = self.runner.prefill(batch.tables, batch.token_lists, batch.cached)
                    logits, event = result.logits, prefill_event(batch, result)
                case DecodeBatch():
                    logits = self.runner.decode(batch.tables, batch.lengths, batch.last_tokens)
                    event = BatchEvent("decode", len(batch.seqs))
        except BaseException:
            self.scheduler.failed_to_run()
            raise
        self.scheduler.ran()
        chosen = self.runner.choose_tokens(logits, batch.seqs, masks)
        advanced = self.scheduler.postprocess(batch, chosen.tokens, chosen.logprobs)
        return StepOutput(advanced.tokens, scheduled.preempted, advanced.failed, [event])

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove these sequences wherever they are (running, preempted, waiting), freeing their
        blocks; used for cancellation, deadlines and failed steps."""
        return self.scheduler.abort(keys)


def prefill_event(batch: PrefillBatch, result: PrefillResult) -> BatchEvent:
    real, computed = batch.prompt_tokens, result.computed_tokens
    return BatchEvent(
        "prefill", len(batch.seqs), computed, result.forwards, (computed - real) / real, prompt_tokens=real
    )
