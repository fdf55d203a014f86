"""Sequences whose adapter is not resident yet: parked beside the batcher while a thread loads it,
queued the step after it is installed, refused (``adapter_unavailable``, alone) when it cannot
load. A resident adapter whose slot another waits for (it drains) takes no new sequences until
it has been swapped out and back, so that no adapter waits for a slot forever. Parked sequences
are held like waiting ones: cancels, deadlines and the no-hoarding bound see them."""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.lora.pool import AdapterKey, LoraPool
from tokenfleet.protocol import ErrorCode, Refusal


@dataclass
class Opened:
    """What a look at the pool let through: sequences to queue now (with their arrival time) and
    those whose adapter cannot load."""

    ready: list[tuple[SeqState, float]] = field(default_factory=list)
    refused: list[tuple[SeqState, Refusal]] = field(default_factory=list)


def adapter_key(seq: SeqState) -> AdapterKey | None:
    """The adapter ``seq`` runs under, by name and directory (None: the base model)."""
    if seq.request.adapter is None or seq.adapter_path is None:
        return None
    return seq.request.adapter, seq.adapter_path


class AdapterGate:
    def __init__(self, pool: LoraPool | None):
        self.pool = pool
        self._parked: dict[AdapterKey, list[tuple[SeqState, float]]] = {}

    def refusal(self, seq: SeqState) -> Refusal | None:
        """Why ``seq``'s adapter can never run here (None: it can, or it names none)."""
        if seq.request.adapter is None:
            return None
        if self.pool is None:
            message = "this worker serves no adapters (--max-loras 0, --compile, or not on a CPU)"
            return Refusal(ErrorCode.ADAPTER_UNAVAILABLE, message)
        if seq.adapter_path is None:
            return Refusal(
                ErrorCode.ADAPTER_UNAVAILABLE, f"no adapter {seq.request.adapter!r} is known to this fleet"
            )
        return None

    def park(self, seq: SeqState, arrived: float) -> bool:
        """Park ``seq`` while its adapter loads or drains (True), or let it through at once
        (False: it names none, or its adapter is resident)."""
        key = adapter_key(seq)
        if key is None or self.pool is None:
            return False
        if key != self.pool.draining and self.pool.slot_of(key) is not None:
            return False
        self.pool.load(key)
        self._parked.setdefault(key, []).append((seq, arrived))
        return True

    def slots(self, seqs: list[SeqState]) -> list[int] | None:
        """Each row's adapter slot (-1: the base model); None when no row names an adapter."""
        if self.pool is None or not any(s.request.adapter for s in seqs):
            return None
        return [self._slot(adapter_key(s)) for s in seqs]

    def _slot(self, key: AdapterKey | None) -> int:
        if key is None:
            return -1
        assert self.pool is not None
        slot = self.pool.slot_of(key)
        if slot is None:  # never: an adapter in use by a held sequence is not evicted
            raise RuntimeError(f"adapter {key[0]!r} of a running sequence is not resident")
        return slot

    @property
    def has_news(self) -> bool:
        return self.pool is not None and (self.pool.has_news or self._parked_resident())

    def _parked_resident(self) -> bool:
        """Whether sequences wait for an adapter that is resident (and no longer drains)."""
        assert self.pool is not None
        return any(key != self.pool.draining and key in self.pool.names for key in self._parked)

    def open(self, in_use: set[AdapterKey]) -> Opened:
        """Install what has loaded (evicting only adapters none of ``in_use`` names, nor parked
        sequences wait for, unless it drains) and let its sequences through; refuse those whose
        adapter failed to load; reload a drained adapter that sequences wait for."""
        opened = Opened()
        if self.pool is None or not self.has_news:
            return opened
        news = self.pool.poll(in_use, set(self._parked) - {self.pool.draining})
        for key, why in news.failed:
            refusal = Refusal(ErrorCode.ADAPTER_UNAVAILABLE, f"adapter {key[0]!r} cannot be loaded: {why}")
            opened.refused += [(seq, refusal) for seq, _ in self._parked.pop(key, [])]
        for key in list(self._parked):
            if key != self.pool.draining and key in self.pool.names:
                opened.ready += self._parked.pop(key)
            else:
                self.pool.load(key)  # a no-op unless it was evicted (drained) while they waited
        return opened

    def held(self) -> list[SeqState]:
        return [seq for waiting in self._parked.values() for seq, _ in waiting]

    def waiting_in(self, lane: int) -> int:
        return sum(seq.request.lane == lane for seq in self.held())

    def drop(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Unpark the sequences with these keys (cancelled, past their deadline); returns them."""
        dropped = []
        for name in list(self._parked):
            keep = [(s, t) for s, t in self._parked[name] if s.key not in keys]
            dropped += [s for s, _ in self._parked[name] if s.key in keys]
            if keep:
                self._parked[name] = keep
            else:
                del self._parked[name]
        return dropped

    def resident(self) -> tuple[str, ...]:
        return tuple(self.pool.resident()) if self.pool is not None else ()
