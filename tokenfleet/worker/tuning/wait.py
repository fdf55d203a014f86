"""The worker's side of ``--ttft-target-ms``: feed each lane's :class:`WaitController` what the
loop measures (arrivals, first tokens, prefill and decode times), hand the wait it chooses to the
core, export it, and log it when it moves."""

from __future__ import annotations

import logging
import time

from tokenfleet.batcher.ttft_target import WaitController
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.interface import EngineCore, StepOutput
from tokenfleet.protocol import LANES
from tokenfleet.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # a moving wait is logged at most this often (always when it halves or doubles)


class WaitTuning:
    """One controller per lane that has a TTFT target; the other lanes keep ``max_wait_ms``."""

    def __init__(self, batching: DynamicBatchingConfig, core: EngineCore, metrics: WorkerMetrics):
        self.core = core
        self.metrics = metrics
        targets = (batching.ttft_target_ms, batching.batch_ttft_target_ms)
        self.controllers: dict[int, WaitController] = {
            lane: WaitController(target / 1000, batching.max_wait_s)
            for lane, target in enumerate(targets)
            if target is not None
        }
        self._logged: dict[int, tuple[float, float]] = {}  # lane -> (when, wait) last logged
        self._in_force: dict[int, float] = {}  # lane -> the wait the core was last given
        for lane in range(len(LANES)):
            controller = self.controllers.get(lane)
            self._hand_over(lane, controller.wait_s if controller else batching.max_wait_s)

    def arrived(self, lane: int) -> None:
        if lane in self.controllers:
            self.controllers[lane].arrived()

    def observe(self, output: StepOutput, seconds: float) -> None:
        """What one step took and made: prefill or decode time, and first tokens' TTFT."""
        if not self.controllers:
            return
        prompt_tokens = sum(b.prompt_tokens for b in output.batches if b.kind == "prefill")
        started = sum(b.size for b in output.batches if b.kind == "prefill")
        for controller in self.controllers.values():
            if started:
                controller.prefill_ran(prompt_tokens, started, seconds)
            elif output.tokens:
                controller.decode_ran(seconds)
        for out in output.tokens:
            seq = out.seq
            lane = self.controllers.get(seq.request.lane)
            if lane is not None and out.index == 0 and seq.first_token_at is not None:
                lane.first_token(max(0.0, seq.first_token_at - seq.enqueued_wall))

    def apply(self) -> None:
        """Hand each controller's current wait to the core (its batcher reads it when it forms)
        and export it, when it moved: this runs every turn, the wait changes twice a second."""
        for lane, controller in self.controllers.items():
            wait = controller.current()
            if wait != self._in_force[lane]:
                self._hand_over(lane, wait)
            self._maybe_log(lane, controller)

    def _hand_over(self, lane: int, wait: float) -> None:
        self.core.set_wait(lane, wait)
        self._in_force[lane] = wait
        self.metrics.wait_in_force(LANES[lane], wait * 1000)

    def _maybe_log(self, lane: int, controller: WaitController) -> None:
        now, wait = time.monotonic(), controller.wait_s
        when, logged = self._logged.get(lane, (0.0, -1.0))
        moved = abs(wait - logged) > 0.001
        big = logged <= 0 or not (0.5 <= wait / logged <= 2) if wait > 0 else logged > 0
        if moved and (big or now - when >= LOG_EVERY_S):
            self._logged[lane] = (now, wait)
            log.info("%s lane: %s", LANES[lane], controller.describe())
