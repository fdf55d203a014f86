"""The allowed-token masks of a step's constrained rows, by llguidance: checked against the token
drawn where that is exact, else filled in one parallel call on a thread of its own, started
before the forward pass and collected after it. Rows without a grammar cost nothing."""

from __future__ import annotations

import os
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
    bitmask, one row per entry of ``rows``), the wall seconds filling them took and the CPU seconds
    llguidance's threads spent on it (None where the OS does not say)."""

    rows: list[int]
    bits: torch.Tensor
    fill_s: float
    cpu_s: float | None = None

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
    """Fills the masks of constrained rows for one model's vocabulary.

    A full mask walks the vocabulary (tens of microseconds, and milliseconds inside a string with
    ``maxLength`` or a counted pattern), so a row drawn greedily or at plain temperature draws
    without one and the grammar only checks the token drawn (a microsecond); where it refuses it,
    the row is masked then and drawn again from an independent number. Both are exact: a greedy
    row's argmax is its masked argmax whenever the mask allows it, and a draw kept when allowed and
    redrawn from the masked distribution otherwise is a draw from the masked distribution. The
    check equals the mask except where the grammar forces the next bytes (the mask then keeps only
    their canonical tokens), so such rows are masked first, while the model runs, with the rows
    whose draw needs the mask (logprobs, which come from the masked distribution; top-k or top-p,
    which it changes)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        # llguidance's parallel executors, made on first use, and their threads' ids (for their CPU
        # time): one beside the forward pass (on 80% of the cores), one after it (on all of them)
        self._executors: dict[bool, tuple[Any, set[int]]] = {}
        self.check_first = True  # False: every constrained row masked before drawing (benchmarks)
        self._thread: ThreadPoolExecutor | None = None
        self._waited_s = 0.0  # this step's wait for the masks filled while the model ran
        # newest last, for benchmarks, one entry per step with constrained rows: the grammar's CPU
        # seconds per constrained row (checks, and fills as the OS counts llguidance's threads), the
        # seconds the step spent on the grammar after its forward pass (what it cost the step), and
        # the share of constrained rows that needed a full mask
        self.cpu_s: deque[float] = deque(maxlen=4096)
        self.wait_s: deque[float] = deque(maxlen=4096)
        self.masked: deque[float] = deque(maxlen=4096)

    def start(self, seqs: list[SeqState]) -> PendingMasks | None:
        """Begin, on a thread of its own, filling the masks of the constrained rows of ``seqs`` that
        need them before a token is drawn; None when no row is constrained."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._thread.submit(self._fill_first, rows, [seqs[i] for i in rows])

    def collect(self, pending: PendingMasks | None) -> RowMasks | None:
        """The masks :meth:`start` began (waiting for them if need be)."""
        if pending is None:
            return None
        began = time.perf_counter()
        masks = pending.result()
        self._waited_s += time.perf_counter() - began
        return masks

    def refused(
        self, seqs: list[SeqState], tokens: list[int | None], masked: RowMasks | None
    ) -> RowMasks | None:
        """The masks, filled now, of the constrained rows drawn without one whose grammar refuses
        ``tokens[row]`` (None when it refuses none); ``masked``: the rows masked before drawing."""
        began, check_cpu = time.perf_counter(), time.thread_time()
        first = set(masked.rows) if masked is not None else set()
        constrained = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        rows = [
            i
            for i in constrained
            if i not in first and tokens[i] is not None and seqs[i].matcher.validate_tokens([tokens[i]]) != 1
        ]
        check_cpu = time.thread_time() - check_cpu
        late = self._fill(rows, [seqs[i].matcher for i in rows], after_forward=True) if rows else None
        if constrained:
            fills = [m.cpu_s for m in (masked, late) if m is not None]
            if None not in fills:
                self.cpu_s.append((check_cpu + sum(f for f in fills if f is not None)) / len(constrained))
            self.wait_s.append(self._waited_s + time.perf_counter() - began)
            self.masked.append((len(first) + len(rows)) / len(constrained))
        self._waited_s = 0.0
        return late

    def _fill_first(self, rows: list[int], seqs: list[SeqState]) -> RowMasks:
        """The masks of the rows (of ``rows``) that need theirs before drawing; its CPU time counts
        the choice (forced bytes are looked for in every row)."""
        began = time.thread_time()
        first = [
            (row, seq)
            for row, seq in zip(rows, seqs)
            if not self.check_first or mask_first(seq) or seq.matcher.compute_ff_bytes()
        ]
        chosen_s = time.thread_time() - began
        if not first:
            return RowMasks([], torch.zeros(0, 0, dtype=torch.int32), 0.0, chosen_s)
        masks = self._fill([row for row, _ in first], [seq.matcher for _, seq in first], after_forward=False)
        return RowMasks(
            masks.rows, masks.bits, masks.fill_s, None if masks.cpu_s is None else masks.cpu_s + chosen_s
        )

    def _fill(self, rows: list[int], matchers: list[Any], after_forward: bool) -> RowMasks:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        if after_forward not in self._executors:
            self._executors[after_forward] = _executor(1.0 if after_forward else 0.8)
        executor, threads = self._executors[after_forward]
        cpu_before = threads_cpu_s(threads)
        began = time.perf_counter()
        bits = allocate_token_bitmask(len(rows), self.vocab_size)
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)
        fill_s = time.perf_counter() - began
        cpu_after = threads_cpu_s(threads)
        cpu_s = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
        return RowMasks(rows, bits, fill_s, cpu_s)


def mask_first(seq: SeqState) -> bool:
    """Whether a constrained row needs its full mask before its token is drawn: for logprobs (of
    the masked distribution) or top-k / top-p (which cut the masked distribution, not the raw)."""
    return seq.request.logprobs is not None or (seq.temperature > 0 and (seq.top_k > 0 or seq.top_p < 1.0))


def _executor(share: float) -> tuple[Any, set[int]]:
    """An llguidance executor on ``share`` of the cores this process may use (0.8 is llguidance's
    own default), and the ids of the threads it started (empty if they cannot be told)."""
    import llguidance

    threads = max(1, min(32, int(len(os.sched_getaffinity(0)) * share)))
    before = _thread_ids()
    executor = llguidance.LLExecutor(num_threads=threads)
    started = _thread_ids() - before
    return executor, started if len(started) == threads else set()


def _thread_ids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def threads_cpu_s(tids: set[int]) -> float | None:
    """CPU seconds the threads ``tids`` of this process have run, from Linux's schedstat (ns);
    None where it cannot be read."""
    if not tids:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9
