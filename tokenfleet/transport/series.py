"""The fleet's last hour as a small time series in Redis, for the dashboard's charts.

Each worker adds what it did since its last heartbeat (tokens, requests started and ended, the sum
of their queue times and TTFTs, a TTFT histogram) to the hash of the current
:data:`SLOT_S`-second slot, ``P:series:<slot>``, with HINCRBY: the fleet's workers sum into one
hash per slot, which expires after :data:`KEEP_S`. Memory stays bounded (at most
``KEEP_S / SLOT_S`` small hashes, whatever the fleet's size) and a reader fetches the hour in one
round trip.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.protocol import Keys, as_text

SLOT_S = 10  # seconds per point
KEEP_S = 3600  # points kept: the last hour
TTFT_BOUNDS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # histogram upper bounds


@dataclass
class Tally:
    """What one worker did since it last wrote (its owner starts a new one after each write)."""

    tokens: int = 0
    started: int = 0
    finished: int = 0
    failed: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS_S) + 1))

    def start(self, queue_s: float, ttft_s: float) -> None:
        self.started += 1
        self.queue_s += queue_s
        self.ttft_s += ttft_s
        self.ttft_counts[bisect.bisect_left(TTFT_BOUNDS_S, ttft_s)] += 1

    def fields(self) -> dict[str, float]:
        """The counts as hash fields, zeros left out."""
        fields: dict[str, float] = {
            "tokens": self.tokens,
            "started": self.started,
            "finished": self.finished,
            "failed": self.failed,
            "queue_s": round(self.queue_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            **{f"ttft_le_{k}": n for k, n in enumerate(self.ttft_counts)},
        }
        return {name: value for name, value in fields.items() if value}


def add_sample(pipe: Any, keys: Keys, sample: dict[str, float], now: float) -> None:
    """Queue on ``pipe`` the commands that add ``sample`` (:meth:`Tally.fields`) to its slot."""
    if not sample:
        return
    key = keys.series(int(now // SLOT_S))
    for name, value in sample.items():
        if isinstance(value, float):
            pipe.hincrbyfloat(key, name, value)
        else:
            pipe.hincrby(key, name, value)
    pipe.expire(key, KEEP_S + SLOT_S)


def read_series(
    client: Any, keys: Keys, now: float | None = None, span_s: int = KEEP_S
) -> list[dict[str, Any]]:
    """The last ``span_s`` seconds, one point per slot (the slot still filling left out): its start
    (``t``, Unix seconds), tokens per second, requests started and failed per minute, mean queue
    time and TTFT, and the TTFT's median read off the histogram (None without requests)."""
    now = time.time() if now is None else now
    last = int(now // SLOT_S) - 1
    slots = list(range(last - span_s // SLOT_S + 1, last + 1))
    pipe = client.pipeline(transaction=False)
    for slot in slots:
        pipe.hgetall(keys.series(slot))
    return [_point(slot, raw) for slot, raw in zip(slots, pipe.execute())]


def _point(slot: int, raw: dict[Any, Any]) -> dict[str, Any]:
    values = {as_text(k): float(v) for k, v in raw.items()}
    started = values.get("started", 0.0)
    counts = [int(values.get(f"ttft_le_{k}", 0)) for k in range(len(TTFT_BOUNDS_S) + 1)]
    return {
        "t": slot * SLOT_S,
        "tokens_per_s": round(values.get("tokens", 0.0) / SLOT_S, 1),
        "requests_per_min": round(started * 60 / SLOT_S, 1),
        "failed_per_min": round(values.get("failed", 0.0) * 60 / SLOT_S, 1),
        "queue_ms": round(values.get("queue_s", 0.0) * 1000 / started, 1) if started else None,
        "ttft_ms": round(values.get("ttft_s", 0.0) * 1000 / started, 1) if started else None,
        "ttft_p50_ms": _median_bound_ms(counts),
    }


def _median_bound_ms(counts: Iterable[int]) -> float | None:
    """The histogram bucket's upper bound under which half of the requests started (the last,
    open bucket reads as twice the largest bound)."""
    counts = list(counts)
    total = sum(counts)
    if not total:
        return None
    seen = 0
    bounds = (*TTFT_BOUNDS_S, TTFT_BOUNDS_S[-1] * 2)
    for bound, n in zip(bounds, counts):
        seen += n
        if seen * 2 >= total:
            return bound * 1000
    return bounds[-1] * 1000
