"""A worker's heartbeat as its readers see it: the msgpack map each worker keeps under its name in
``{P}:workers``, beaten every few seconds with ``seen`` set to the time of the beat. No I/O."""

from __future__ import annotations

from typing import Any

from tokenfleet.protocol.codec import unpack

STALE_AFTER_S = 10.0  # a worker silent this long is not alive (heartbeats come every 2 s)


def parse_heartbeat(name: bytes | str, raw: bytes, now: float) -> dict[str, Any] | None:
    """Worker ``name``'s heartbeat ``raw`` as read at ``now`` (``time.time()``): its fields with
    ``name``, ``alive`` and ``seen_s_ago``; None where it is not a msgpack map (skipped)."""
    try:
        beat = unpack(raw)
    except ValueError:
        return None
    if not isinstance(beat, dict):
        return None
    age = now - float(beat.get("seen", 0))
    worker = name.decode() if isinstance(name, bytes) else str(name)
    return {"name": worker, "alive": age < STALE_AFTER_S, "seen_s_ago": round(age, 1), **beat}
