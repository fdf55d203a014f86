"""One step of the engine core inside a worker turn: its batch wait tuned first, a failed forward
pass failing only the sequences it held, the step's batches counted and logged, its tokens
published. Returns what the step made and how long it took."""

from __future__ import annotations

import logging
import time

from tokenfleet.core.interface import EngineCore, StepOutput
from tokenfleet.protocol import ErrorCode
from tokenfleet.ratelog import RateLimitedLog
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.policy import TurnPolicy
from tokenfleet.worker.publisher import Publisher
from tokenfleet.worker.tuning.threads import ThreadTuner
from tokenfleet.worker.tuning.wait import WaitTuning

log = logging.getLogger(__name__)


class Stepper:
    def __init__(
        self,
        core: EngineCore,
        tuning: WaitTuning,
        policy: TurnPolicy,
        publisher: Publisher,
        metrics: WorkerMetrics,
        threads: ThreadTuner | None,
    ):
        """``threads``: re-measures the compute threads on decode steps (None: they stay as set)."""
        self.core = core
        self.threads = threads
        self.tuning = tuning
        self.policy = policy
        self.publisher = publisher
        self.metrics = metrics
        self._warn = RateLimitedLog(log)  # a step failing again and again: one line per 10 s

    def step(self, flush: bool) -> tuple[StepOutput, float]:
        """One step of the core (``flush``: start what waits without waiting for its batch to be
        due); what it made and the seconds the step took."""
        self.tuning.apply()
        began = time.perf_counter()
        refused = self.core.open_parked()
        if refused:
            self.publisher.publish(StepOutput(refused=refused))
        try:
            output = self.core.step(flush=flush)
        except Exception as e:  # a failed forward pass fails its sequences, never the worker
            started = self.core.running()
            message = "step failed; failing the %d sequences it held"
            self._warn.log(logging.ERROR, "step", message, len(started), exc_info=True)
            for seq in self.core.abort({s.key for s in started}):
                self.publisher.fail(seq, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            return StepOutput(), time.perf_counter() - began
        seconds = time.perf_counter() - began
        self.tuning.observe(output, seconds)
        for event in output.batches:
            self.metrics.observe_batch(event)
            if event.kind == "prefill":
                log.info("batch size %d (%s)", event.size, event.describe())
            if self.threads is not None and len(output.batches) == 1:
                self.threads.ran(
                    event.kind, event.prompt_tokens if event.kind == "prefill" else event.size, seconds
                )
        self.metrics.preempted(len(output.preempted))
        if output.tokens and not any(event.kind == "prefill" for event in output.batches):
            self.policy.step_done(seconds)

        self.publisher.publish(output)
        return output, seconds
