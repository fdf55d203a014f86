"""bench.compare's workloads (the same token ids for every system) and what each request's
reply is reduced to (:class:`Trace`, :func:`summarize`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from bench.common import percentile


@dataclass
class Req:
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float


def max_seq_len_for(reqs: list[Req]) -> int:
    """The tokenfleet rows' ``max_seq_len``: room for the longest request, and twice the bucket
    of the longest prompt (their one bucket is half of it)."""
    bucket = 1 << (max(len(r.prompt_ids) for r in reqs) - 1).bit_length()
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs)
    return max(2 * bucket, 1 << (longest - 1).bit_length())


def make_workload(kind: str, n: int, prompt_len: int, new_tokens: int, rate: float, seed: int) -> list[Req]:
    from tokenfleet.models import VOCAB_SIZE

    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE - 64) for _ in range(length)]  # no specials, no padding ids

    if kind == "fixed":
        return [Req(prompt(prompt_len), new_tokens, 0.0) for _ in range(n)]
    if kind == "mixed":
        return [
            Req(prompt(rng.randint(16, 2 * prompt_len)), rng.randint(16, 2 * new_tokens), 0.0)
            for _ in range(n)
        ]
    if kind == "poisson":
        t, reqs = 0.0, []
        for _ in range(n):
            reqs.append(Req(prompt(prompt_len), new_tokens, t))
            t += rng.expovariate(rate)
        return reqs
    raise SystemExit(f"unknown workload {kind!r}")


# -- results --------------------------------------------------------------------------------------


@dataclass
class Trace:
    """One request as a system served it: arrival, a timestamp per token, the tokens."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def summarize(name: str, traces: list[Trace], wall: float, note: str = "") -> dict:
    ttft = [(t.token_times[0] - t.arrival) * 1000 for t in traces if t.token_times]
    itl = [(b - a) * 1000 for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    tokens = sum(len(t.token_ids) for t in traces)

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return {
        "system": name,
        "requests": len(traces),
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_mean_ms": r(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_p50_ms": r(percentile(ttft, 50)),
        "ttft_p99_ms": r(percentile(ttft, 99)),
        "itl_p50_ms": r(percentile(itl, 50)),
        "itl_p99_ms": r(percentile(itl, 99)),
        "note": note,
        "_token_ids": [t.token_ids for t in traces],
    }


class Stamper:
    """A ``generate`` streamer that timestamps each step's tokens (the first ``put`` is the prompt)."""

    def __init__(self, traces: list[Trace]):
        self.traces, self.seen_prompt = traces, False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        now = time.perf_counter()
        for trace, token in zip(self.traces, value.reshape(-1).tolist()):
            trace.token_times.append(now)
            trace.token_ids.append(token)

    def end(self) -> None:
        pass


def wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
