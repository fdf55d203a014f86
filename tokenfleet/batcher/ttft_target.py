"""A TTFT target instead of a fixed ``max_wait_ms``: the wait a lane's batch may form for, chosen
at run time from what the worker measures. Pure Python with an injected clock, like the batcher.

The model: a request's time to first token is about the wait plus what the load costs it (the
step it lands behind, its batch's prefill, the queue), measured as the p90 of recent requests'
TTFT less the wait in force (before any, a step plus one prompt's prefill); the prefill grows
with the wait (``1 + rate x wait`` prompts). The wait is the largest that keeps this under
``headroom x target``, and never below one decode step: a shorter wait brings no first token
sooner than the step it lands behind, and splits prefills a burst's arrivals could share. The
headroom is the feedback:
the measured p90 TTFT above the target cuts it at once (and forgets the samples the cut answers);
a p90 well under the target lets it grow back a step at a time. Between the two thresholds
nothing moves, and the wait itself grows by at most half per update but falls at once: a change
of load is answered within a second or two, and the wait does not swing back and forth.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

UPDATE_S = 0.5  # how often the wait is recomputed
WINDOW_S = 5.0  # arrivals older than this are forgotten
SAMPLES_S = 2.0  # TTFT samples older than this are forgotten: a burst shows within a second
MIN_SAMPLES = 3  # TTFT samples needed before they count
HEADROOM_START, HEADROOM_MIN, HEADROOM_MAX = 0.6, 0.05, 0.75  # the rest: what the worker cannot see
CUT, RAISE = 0.6, 0.05  # headroom x CUT on a miss; + RAISE when p90 < RELAX x target
RELAX = 0.75
GROWTH, GROWTH_FLOOR_S = 1.5, 0.002  # the wait grows to at most x1.5 + 2 ms per update


class Ewma:
    """Exponentially weighted moving average (None until the first sample)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class WaitController:
    """The batch wait of one lane under a TTFT target (seconds throughout)."""

    def __init__(self, target_s: float, max_wait_s: float, clock: Callable[[], float] = time.monotonic):
        if target_s <= 0:
            raise ValueError(f"the TTFT target must be > 0, got {target_s * 1000:g} ms")
        self.target_s = target_s
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.headroom = HEADROOM_START
        self.wait_s = 0.0
        self.last_p90: float | None = None
        self._arrivals: deque[float] = deque()
        self._ttfts: deque[tuple[float, float, float]] = deque()  # (when, ttft, wait in force)
        self._prompt_tokens = Ewma()
        self._prefill_s_per_token = Ewma()
        self._step_s = Ewma()
        self._started = clock()
        self._next_update = self._started

    # -- what the worker measures --------------------------------------------------------------

    def arrived(self) -> None:
        """A request of this lane came in."""
        self._arrivals.append(self.clock())

    def first_token(self, ttft_s: float) -> None:
        """A request of this lane got its first token ``ttft_s`` after it was enqueued."""
        self._ttfts.append((self.clock(), ttft_s, self.wait_s))

    def prefill_ran(self, prompt_tokens: int, sequences: int, seconds: float) -> None:
        """A prefill of ``sequences`` prompts, ``prompt_tokens`` in all, took ``seconds``."""
        if prompt_tokens > 0 and sequences > 0:
            self._prefill_s_per_token.add(seconds / prompt_tokens)
            self._prompt_tokens.add(prompt_tokens / sequences)

    def decode_ran(self, seconds: float) -> None:
        self._step_s.add(seconds)

    # -- the decision ---------------------------------------------------------------------------

    def current(self) -> float:
        """The wait in force now (recomputed every ``UPDATE_S``)."""
        now = self.clock()
        if now >= self._next_update:
            self._next_update = now + UPDATE_S
            self._update(now)
        return self.wait_s

    def arrival_rate(self, now: float) -> float:
        """Requests per second over the window (or since the start, when that is shorter)."""
        span = min(WINDOW_S, max(now - self._started, UPDATE_S))
        return len(self._arrivals) / span

    def _update(self, now: float) -> None:
        while self._arrivals and self._arrivals[0] < now - WINDOW_S:
            self._arrivals.popleft()
        while self._ttfts and self._ttfts[0][0] < now - SAMPLES_S:
            self._ttfts.popleft()
        self._adjust_headroom()
        self.wait_s = self._bounded(self._modelled_wait(now))

    def _adjust_headroom(self) -> None:
        if len(self._ttfts) < MIN_SAMPLES:
            return
        self.last_p90 = measured = p90([ttft for _, ttft, _ in self._ttfts])
        if measured > self.target_s:
            self.headroom = max(HEADROOM_MIN, self.headroom * CUT)
            self._ttfts.clear()  # judge the cut on the requests that come after it
        elif measured < RELAX * self.target_s:
            self.headroom = min(HEADROOM_MAX, self.headroom + RAISE)

    def _modelled_wait(self, now: float) -> float:
        """The largest wait whose modelled TTFT stays within ``headroom x target``."""
        prefill_one = self._prefill_s_per_token.get() * self._prompt_tokens.get()
        budget = self.headroom * self.target_s - self._load_cost(prefill_one)
        return budget / (1 + prefill_one * self.arrival_rate(now))

    def _load_cost(self, prefill_one: float) -> float:
        """What a first token costs beyond the wait: measured when there are samples."""
        if len(self._ttfts) >= MIN_SAMPLES:
            return max(0.0, p90([ttft - wait for _, ttft, wait in self._ttfts]))
        return self._step_s.get() + prefill_one

    def _bounded(self, wait: float) -> float:
        floor = min(self._step_s.get(), self.max_wait_s)
        wait = min(max(wait, floor), self.max_wait_s)
        if wait > self.wait_s:  # up slowly, down at once
            wait = min(wait, self.wait_s * GROWTH + GROWTH_FLOOR_S)
        return wait

    def describe(self) -> str:
        """One log line's worth of what the decision rests on."""
        measured = "-" if self.last_p90 is None else f"{self.last_p90 * 1000:.0f} ms"
        return (
            f"wait {self.wait_s * 1000:.1f} ms for a {self.target_s * 1000:g} ms TTFT target "
            f"(p90 {measured}, {self.arrival_rate(self.clock()):.1f} req/s, "
            f"prefill {self._prefill_s_per_token.get() * 1e6:.0f} us/token, "
            f"step {self._step_s.get() * 1000:.1f} ms, headroom {self.headroom:.2f})"
        )
