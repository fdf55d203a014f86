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

    def allowed(self, vocab: int) -> torch.Tensor:
        """The masks as booleans ``[len(rows), vocab]``; tokens beyond the bitmask are disallowed."""
        shifts = torch.arange(32, dtype=torch.int32)
        bools = ((self.bits[:, :, None] >> shifts) & 1).bool().flatten(1)
        if bools.shape[1] < vocab:
            bools = torch.nn.functional.pad(bools, (0, vocab - bools.shape[1]), value=False)
        return bools[:, :vocab]


PendingMasks = Future[RowMasks]
"""Masks being filled: :meth:`GrammarMasks.collect` waits for them."""


class GrammarMasks:
    """Fills the masks of constrained rows for one model's vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._executor: Any = None  # llguidance's parallel executor, made on first use
        self._thread: ThreadPoolExecutor | None = None
        # seconds per constrained row of each step's mask fill, newest last (benchmarks read it)
        self.fill_s: deque[float] = deque(maxlen=4096)

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
        masks = pending.result()
        self.fill_s.append(masks.fill_s / len(masks.rows))
        return masks

    def _fill(self, rows: list[int], matchers: list[Any]) -> RowMasks:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        began = time.perf_counter()
        bits = allocate_token_bitmask(len(rows), self.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bits)
        return RowMasks(rows, bits, time.perf_counter() - began)
