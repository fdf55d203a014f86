"""The allowed-token masks of a step's constrained rows: filled by llguidance in one parallel call
on a thread of its own, started before the forward pass and collected after it, so the mask's
time hides behind the model's. Rows without a grammar cost nothing."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tokenfleet.core.sequence import SeqState


@dataclass(frozen=True)
class RowMasks:
    """The allowed tokens of the rows ``rows`` of a step (``bits``: llguidance's packed int32
    bitmask, one row per entry of ``rows``) and the seconds filling them took."""

    rows: list[int]
    bits: torch.Tensor
    fill_s: float

    def blocked(self, vocab: int) -> torch.Tensor:
        """Where the masks forbid a token, as booleans ``[len(rows), vocab]``; tokens beyond the
        bitmask are forbidden. Unpacked byte by byte: a quarter of the memory of int32 shifts."""
        octets = self.bits.view(torch.uint8)  # little-endian: token 8*i + j is bit j of byte i
        shifts = torch.arange(8, dtype=torch.uint8)
        blocked = ((octets[:, :, None] >> shifts) & 1).flatten(1) == 0
        if blocked.shape[1] < vocab:
            blocked = torch.nn.functional.pad(blocked, (0, vocab - blocked.shape[1]), value=True)
        return blocked[:, :vocab]


PendingMasks = Future[RowMasks]
"""Masks being filled: :meth:`GrammarMasks.collect` waits for them."""


class GrammarMasks:
    """Fills the masks of constrained rows for one model's vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor: Any = None  # llguidance's parallel executor, made on first use
        self._thread: ThreadPoolExecutor | None = None
        # newest last, for benchmarks: each step's fill in wall seconds per constrained row, and the
        # seconds the step waited for its masks after its forward pass (what the masks cost it)
        self.fill_s: deque[float] = deque(maxlen=4096)
        self.wait_s: deque[float] = deque(maxlen=4096)

    def start(self, seqs: list[SeqState]) -> PendingMasks | None:
        """Begin filling the masks of the rows of ``seqs`` that have a grammar; None when none has."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        if self._thread is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        matchers = [seqs[i].matcher for i in rows]
        return self._thread.submit(self._fill, rows, matchers)

    def collect(self, pending: PendingMasks | None) -> RowMasks | None:
        """The masks :meth:`start` began (waiting for them if need be)."""
        if pending is None:
            return None
        began = time.perf_counter()
        masks = pending.result()
        self.wait_s.append(time.perf_counter() - began)
        self.fill_s.append(masks.fill_s / len(masks.rows))
        return masks

    def _fill(self, rows: list[int], matchers: list[Any]) -> RowMasks:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        began = time.perf_counter()
        bits = allocate_token_bitmask(len(rows), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bits)
        return RowMasks(rows, bits, time.perf_counter() - began)
