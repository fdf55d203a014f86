"""When a turn of the worker talks to Redis, and whether that round trip overlaps the step.

Pure: no Redis, no torch; the clock is injected, so it is tested on its own.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from tokenfleet.protocol import LANES

log = logging.getLogger(__name__)

OVERLAP_MIN_SHARE = 0.05
"""overlap_io auto overlaps a round trip that costs at least this share of a decode step; below
it, hiding it is not worth acting on new work and cancels one step later."""
EMA = 0.2
"""Weight of the newest sample in the step and round-trip averages."""


class Plan(enum.Enum):
    """What a turn does with Redis before (or during) its step."""

    SEPARATE = "separate"  # no batch riding: flush replies, read work (maybe blocking), read cancels
    INLINE = "inline"  # one shared round trip (replies, work, cancels) before the step
    OVERLAP = "overlap"  # the same round trip on the I/O thread during the step
    SKIP = "skip"  # nothing to send and the last read is recent: no round trip this turn
    DRAIN = "drain"  # stopping: flush replies and read cancels, take no new work

    @property
    def shared(self) -> bool:
        return self in (Plan.INLINE, Plan.OVERLAP)


def _average(mean: float, sample: float) -> float:
    """An exponential moving average; the first sample starts it."""
    return sample if mean == 0.0 else (1 - EMA) * mean + EMA * sample


class TurnPolicy:
    """Chooses each turn's :class:`Plan` from what it has measured.

    While a batch runs on one server, the step's replies, the read of new work and the read of
    cancels share one pipelined round trip (a cluster pipeline keeps no order across nodes, so
    there they go separately). A turn with nothing to send skips it unless ``exchange_interval_s``
    has passed since the last one. ``overlap_io``: ``on`` always runs it during the step, ``off``
    never, ``auto`` when it costs at least :data:`OVERLAP_MIN_SHARE` of a decode step.
    """

    def __init__(
        self,
        overlap_io: str,
        shared: bool,
        exchange_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.overlap_io = overlap_io
        self.shared = shared
        self.exchange_interval_s = exchange_interval_s
        self.clock = clock
        self.decode_step_s = 0.0  # moving averages
        self.round_trip_s = 0.0
        self._last_exchange = float("-inf")
        self._overlap_pays = False  # auto's last choice, logged when it changes

    def rides_on_steps(self, busy: bool, stopping: bool) -> bool:
        """Whether the round trip goes with the steps of a running batch rather than once a turn
        on its own (then the step's replies wait for the next turn's round trip)."""
        return self.shared and busy and not stopping

    def plan(self, busy: bool, stopping: bool, replies_waiting: bool) -> Plan:
        """This turn's plan; a shared round trip is noted as begun now."""
        if stopping:
            return Plan.DRAIN
        if not self.rides_on_steps(busy, stopping):
            return Plan.SEPARATE
        now = self.clock()
        if not replies_waiting and now - self._last_exchange < self.exchange_interval_s:
            return Plan.SKIP
        self._last_exchange = now
        return Plan.OVERLAP if self._overlap() else Plan.INLINE

    def step_done(self, seconds: float) -> None:
        """A decode step took ``seconds`` (prefills say nothing of the steps to come)."""
        self.decode_step_s = _average(self.decode_step_s, seconds)

    def round_trip_done(self, seconds: float) -> None:
        """An inline round trip took ``seconds``."""
        self.round_trip_s = _average(self.round_trip_s, seconds)

    def _overlap(self) -> bool:
        if self.overlap_io != "auto":
            return self.overlap_io == "on"
        pays = self.round_trip_s >= OVERLAP_MIN_SHARE * self.decode_step_s > 0
        if pays != self._overlap_pays:
            self._overlap_pays = pays
            log.info(
                "Redis round trip %.2f ms against a %.2f ms decode step: %s",
                self.round_trip_s * 1000,
                self.decode_step_s * 1000,
                "overlapping it with the next step" if pays else "running it between steps",
            )
        return pays


def read_budget(size: int, running_lanes: list[int], top_waiting: int, waiting: int) -> tuple[int, ...]:
    """How many new entries each lane may read: what free slots can start, plus a quarter of a
    batch read ahead, never more than ``size`` (max_batch_size) waiting. No hoarding: what a busy
    worker leaves unread, an idle one takes (affinity's stealing included). The top lane counts
    only its own sequences, so batch-lane work never keeps an interactive request unread (it may
    preempt them). ``running_lanes``: the lane of every started sequence."""
    ahead = max(1, size // 4)
    top_running = sum(lane == 0 for lane in running_lanes)
    top = min(size, size - top_running + ahead) - top_waiting
    rest = min(size, size - len(running_lanes) + ahead) - waiting
    return (top, *(rest for _ in LANES[1:]))
