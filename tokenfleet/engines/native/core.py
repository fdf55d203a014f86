"""The native engine core: our scheduler and our model runner behind the core's interface.

A step is a pipeline of values, as in nano-vllm's engine: the scheduler says what runs
(:meth:`Scheduler.schedule`), the runner computes its logits (and, for a prefill, what it
computed), the runner's sampler picks the tokens, and the scheduler says what they did
(:meth:`Scheduler.postprocess`). No Redis here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Limits
from tokenfleet.core.front import CoreFront
from tokenfleet.core.interface import BatchEvent, Capacity, ModelFacts, StepOutput
from tokenfleet.core.scheduler import DecodeBatch, PrefillBatch, Scheduler
from tokenfleet.core.sequence import SeqState
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import TokenLogprob


@dataclass(frozen=True)
class PrefillResult:
    """A prefill's next-token logits ``[B, vocab]`` and what it computed: tokens (padding
    included) in how many forwards."""

    logits: Any
    computed_tokens: int
    forwards: int


@dataclass(frozen=True)
class Chosen:
    """A step's token for each row (None: the row could not be sampled, ``sampling_error`` says
    why) and its logprobs where the request asked for them."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None]


class Runner(Protocol):
    """What the core needs of a model runner (:class:`tokenfleet.engines.native.runner.ModelRunner`)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    def facts(self) -> ModelFacts: ...

    def prefill(
        self, tables: list[list[int]], token_lists: list[list[int]], cached: list[int]
    ) -> PrefillResult: ...

    def decode(self, tables: list[list[int]], lengths: list[int], last_tokens: list[int]) -> Any: ...

    def start_masks(self, seqs: list[SeqState]) -> Any: ...

    def choose_tokens(self, logits: Any, seqs: list[SeqState], masks: Any) -> Chosen: ...


class NativeCore(CoreFront):
    """The ``native`` :class:`~tokenfleet.core.interface.EngineCore`."""

    backend = "native"

    def __init__(
        self,
        runner: Runner,
        batching: DynamicBatchingConfig,
        clock: Callable[[], float] = time.monotonic,
        prefix_caching: bool = True,
    ):
        facts = runner.facts()
        limits = Limits(
            buckets=batching.buckets,
            max_seq_len=batching.max_seq_len,
            max_new_tokens_cap=batching.max_new_tokens_cap,
            vocab_size=facts.vocab_size,
            max_token_chars=facts.max_token_chars,
            kv_tokens_per_seq=runner.num_blocks * runner.block_size,
        )
        super().__init__(facts, limits, batching, clock)
        self.runner = runner
        self.allocator = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching)
        self.scheduler = Scheduler(self.allocator, self.batcher, batching)

    # -- what it holds --------------------------------------------------------------------------

    def held(self) -> list[SeqState]:
        """Every sequence this core holds: running, preempted and waiting."""
        return [*self.running(), *self.waiting()]

    def running(self) -> list[SeqState]:
        return [*self.scheduler.running, *self.scheduler.preempted]

    @property
    def num_waiting(self) -> int:
        """Read from Redis, not yet started (the no-hoarding bound applies to this)."""
        return len(self.batcher) + len(self.scheduler.preempted)

    def waiting_in(self, lane: int) -> int:
        return self.batcher.waiting_in(lane) + self.scheduler.preempted.in_lane(lane)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def capacity(self) -> Capacity:
        return Capacity(
            max_seq_len=self.config.max_seq_len,
            block_size=self.allocator.block_size,
            kv_blocks_total=self.allocator.num_blocks,
            kv_blocks_used=self.allocator.num_used_blocks,
            running=len(self.scheduler.running),
            waiting=self.num_waiting,
            kv_bytes_per_block=self.runner.bytes_per_block,
            prefix_cache_queries=self.allocator.queries,
            prefix_cache_hits=self.allocator.hits,
        )

    def check_idle(self) -> None:
        self.allocator.check_integrity()
        if not self.held() and self.allocator.num_used_blocks:
            raise RuntimeError(f"{self.allocator.num_used_blocks} KV blocks in use with no sequence held")

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
            self.allocator.forget_unconfirmed()  # blocks this step was to fill hold no K/V
            raise
        self.allocator.confirm()
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
