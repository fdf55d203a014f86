"""The native engine core: our scheduler and our model runner behind the core's interface.

A step is a pipeline of values, as in nano-vllm's engine: the scheduler says what runs
(:meth:`Scheduler.schedule`), the runner computes its logits (and, for a prefill, what it
computed), the runner's sampler picks the tokens, and the scheduler says what they did
(:meth:`Scheduler.postprocess`). No Redis here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import replace

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Limits
from tokenfleet.core.batches import DecodeBatch, PrefillBatch
from tokenfleet.core.front import CoreFront
from tokenfleet.core.interface import BatchEvent, Capacity, StepOutput
from tokenfleet.core.scheduler import Scheduler
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.lora.gate import AdapterGate, adapter_key
from tokenfleet.engines.native.own_embeds import OwnEmbeds
from tokenfleet.engines.native.types import PrefillResult, Runner
from tokenfleet.protocol import Refusal, Request
from tokenfleet.protocol.adapters import AdapterRecord


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
        self.adapters = AdapterGate(runner.lora)
        self.embeds = OwnEmbeds(runner, batching, clock)  # embedding requests, on the model's own states

    # -- what it holds --------------------------------------------------------------------------

    def embed_ids(self, request: Request) -> list[int] | Refusal:
        return self.embeds.ids(request, self.facts, self.admission)

    def add(self, seq: SeqState, arrived: float) -> Refusal | None:
        """Queue ``seq``, or park it while its adapter loads; a :class:`Refusal` if it can never
        run here."""
        if seq.request.embed is not None:
            return self.admission.queue(seq, arrived, self.embeds.batcher)
        refusal = self.adapters.refusal(seq)
        refusal = refusal or self.admission.check_tokens(len(seq.prompt_ids), seq.request.max_new_tokens)
        if refusal is not None or self.adapters.park(seq, arrived):
            return refusal
        return super().add(seq, arrived)

    def preload(self, adapters: list[AdapterRecord]) -> None:
        if self.runner.lora is not None:
            for record in adapters[: len(self.runner.lora.names)]:
                self.runner.lora.load((record.name, record.path))

    def held(self) -> list[SeqState]:
        """Every sequence this core holds: running, preempted, waiting and parked."""
        return [*self.running(), *self.waiting(), *self.adapters.held(), *self.embeds.waiting()]

    def running(self) -> list[SeqState]:
        return [*self.scheduler.running, *self.scheduler.preempted, *self.embeds.running]

    @property
    def num_waiting(self) -> int:
        """Read from Redis, not yet started (the no-hoarding bound applies to this)."""
        return self.scheduler.num_waiting + len(self.adapters.held()) + len(self.embeds.batcher)

    def waiting_in(self, lane: int) -> int:
        scheduled = self.batcher.waiting_in(lane) + self.scheduler.preempted.in_lane(lane)
        return scheduled + self.adapters.waiting_in(lane) + self.embeds.batcher.waiting_in(lane)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.adapters.has_news or self.embeds.batcher.is_due()

    def ready_at(self) -> float | None:
        times = [t for t in (super().ready_at(), self.embeds.batcher.ready_at()) if t is not None]
        return min(times, default=None)

    def set_wait(self, lane: int, seconds: float) -> None:
        super().set_wait(lane, seconds)
        self.embeds.batcher.set_wait(lane, seconds)

    def capacity(self) -> Capacity:
        return replace(
            self.scheduler.capacity(self.runner.bytes_per_block), adapters=self.adapters.resident()
        )

    def check_idle(self) -> None:
        self.scheduler.check_idle()

    def close(self) -> None:
        if self.runner.lora is not None:
            self.runner.lora.close()

    # -- stepping -------------------------------------------------------------------------------

    def step(self, flush: bool = False) -> StepOutput:
        """Run one forward pass if any is due; returns what it produced. ``flush`` starts waiting
        requests without waiting for their batch to be due (shutdown)."""
        if self.embeds.is_due(generating=self.scheduler.has_work, flush=flush):
            return self.embeds.step(self.scheduler.allocator, flush)
        self.embeds.generation_ran()
        scheduled = self.scheduler.schedule(flush)
        batch = scheduled.batch
        if batch is None:
            return StepOutput(preempted=scheduled.preempted)
        masks = self.runner.start_masks(batch.seqs)  # grammar masks fill while the model runs
        slots = self.adapters.slots(batch.seqs)
        try:
            match batch:
                case PrefillBatch():
                    result = self.runner.prefill(batch.tables, batch.token_lists, batch.cached, slots)
                    logits, event = result.logits, prefill_event(batch, result)
                case DecodeBatch():
                    logits = self.runner.decode(batch.tables, batch.lengths, batch.last_tokens, slots)
                    event = BatchEvent("decode", len(batch.seqs))
        except BaseException:
            self.scheduler.failed_to_run()
            raise
        self.scheduler.ran()
        chosen = self.runner.choose_tokens(logits, batch.seqs, masks)
        advanced = self.scheduler.postprocess(batch, chosen.tokens, chosen.logprobs)
        return StepOutput(advanced.tokens, scheduled.preempted, advanced.failed, [event])

    def open_parked(self) -> list[tuple[SeqState, Refusal]]:
        """Queue the parked sequences whose adapter is now resident; their refusals where it
        cannot load."""
        in_use = {adapter_key(s) for s in [*self.running(), *self.waiting()]} - {None}
        opened = self.adapters.open(in_use)  # type: ignore[arg-type]  # None removed above
        for seq, arrived in opened.ready:
            refusal = super().add(seq, arrived)
            if refusal is not None:
                opened.refused.append((seq, refusal))
        return opened.refused

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove these sequences wherever they are (running, preempted, waiting, parked), freeing
        their blocks; used for cancellation, deadlines and failed steps."""
        return self.scheduler.abort(keys) + self.adapters.drop(keys) + self.embeds.abort(keys)


def prefill_event(batch: PrefillBatch, result: PrefillResult) -> BatchEvent:
    real, computed = batch.prompt_tokens, result.computed_tokens
    return BatchEvent(
        "prefill", len(batch.seqs), computed, result.forwards, (computed - real) / real, prompt_tokens=real
    )
