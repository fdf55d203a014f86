"""The adapters a worker holds: a fixed number of slots (``--max-loras``), filled from local PEFT
directories on a thread beside the step loop (reading and checking a file never stalls a step),
installed between steps, least recently used evicted when a slot is needed and no sequence held
uses it. An adapter is held by its name and directory (:data:`AdapterKey`): a name removed and
added again with new files is a new adapter here. Which slot each step's rows use goes to the
adapted linears through :class:`LoraStep`."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tokenfleet.config.cpus import become_side_work
from tokenfleet.engines.native.lora.adapter import Adapter, AdapterError, load_adapter
from tokenfleet.engines.native.lora.linear import LoraStep, SlotWeights

log = logging.getLogger(__name__)

RETRY_FAILED_S = 10.0  # an adapter that failed to load is not read again for this long

AdapterKey = tuple[str, str]  # (name, directory)


@dataclass
class PoolNews:
    """What changed since the last look: adapters now resident, and those that cannot load (why)."""

    loaded: list[AdapterKey] = field(default_factory=list)
    failed: list[tuple[AdapterKey, str]] = field(default_factory=list)


class LoraPool:
    def __init__(
        self,
        slots: int,
        max_rank: int,
        linears: dict[str, tuple[int, int]],
        dtype: torch.dtype,
        step: LoraStep,
    ):
        self.max_rank, self.linears, self.dtype, self.step = max_rank, linears, dtype, step
        self.names: list[AdapterKey | None] = [None] * slots  # the adapter in each slot
        self._used: OrderedDict[AdapterKey, None] = OrderedDict()  # resident, least recently used first
        self._loading: dict[AdapterKey, Future[Adapter]] = {}
        self._ready: dict[AdapterKey, Adapter] = {}  # loaded, waiting for a free slot
        self._failed: dict[AdapterKey, tuple[float, str]] = {}  # when and why a load last failed
        # the resident adapter whose slot an adapter waiting for one will take: its new requests
        # wait too, so that steady traffic to every resident adapter cannot hold the slot forever
        self.draining: AdapterKey | None = None
        self._loader = ThreadPoolExecutor(1, "tokenfleet-lora-load", initializer=become_side_work)
        for name in linears:
            step.weights[name] = SlotWeights.empty(slots, dtype)

    def slot_of(self, key: AdapterKey) -> int | None:
        """The slot holding ``key``, if resident (and it becomes the most recently used)."""
        if key not in self._used:
            return None
        self._used.move_to_end(key)
        return self.names.index(key)

    def holds(self, key: AdapterKey) -> bool:
        """Whether ``key`` is resident, loading or loaded waiting for a slot."""
        return key in self._used or key in self._loading or key in self._ready

    def resident(self) -> list[str]:
        return [name for name, _ in self._used]

    @property
    def reading(self) -> int:
        """Adapters whose files are being read now."""
        return sum(not future.done() for future in self._loading.values())

    def load(self, key: AdapterKey) -> None:
        """Start reading adapter ``key`` (name, directory) unless it is resident or on its way (or
        failed a moment ago: its requests then fail at once, without reading the files again)."""
        if self.holds(key):
            return
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < RETRY_FAILED_S:
            done: Future[Adapter] = Future()
            done.set_exception(AdapterError(failed[1]))
            self._loading[key] = done
            return
        name, path = key
        log.info("loading adapter %s from %s", name, path)
        self._loading[key] = self._loader.submit(
            load_adapter, name, path, self.linears, self.max_rank, self.dtype
        )

    @property
    def has_news(self) -> bool:
        """A load has finished (installing it is due), or one waits for a slot."""
        return bool(self._ready) or any(f.done() for f in self._loading.values())

    def poll(
        self, in_use: set[AdapterKey], wanted: set[AdapterKey] | frozenset[AdapterKey] = frozenset()
    ) -> PoolNews:
        """Install finished loads, evicting the least recently used adapters that no running or
        waiting sequence (``in_use``) names and none parked sequences wait for (``wanted``); loads
        that failed are reported with why. When every slot is taken, the least recently used
        adapter that sequences run under starts :attr:`draining` (never one whose sequences are
        all parked: one just installed would be swapped out before it ever ran)."""
        news = PoolNews()
        for key, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[key]
            try:
                self._ready[key] = future.result()
            except Exception as e:  # a bad or odd file: the adapter's requests fail, never the worker
                why = str(e) if isinstance(e, AdapterError) else f"{type(e).__name__}: {e}"
                news.failed.append((key, why))
                last = self._failed.get(key)
                if last is None or time.monotonic() - last[0] >= RETRY_FAILED_S:  # a read, not the memo
                    self._failed[key] = (time.monotonic(), why)
        for key in list(self._ready):
            slot = self._free_slot(in_use | wanted)
            if slot is None:  # every slot holds an adapter in use: it waits for one to finish
                if self.draining is None:
                    self.draining = next((k for k in self._used if k in in_use), None)
                    if self.draining is not None:
                        log.info("adapter %s drains: %s waits for its slot", self.draining[0], key[0])
                break
            self._install(slot, key, self._ready.pop(key))
            news.loaded.append(key)
        if not self._ready:  # nothing waits for a slot (any more): no adapter needs to drain
            self.draining = None
        return news

    def _free_slot(self, in_use: set[AdapterKey]) -> int | None:
        if None in self.names:
            return self.names.index(None)
        victim = next((k for k in self._used if k not in in_use), None)
        if victim is None:
            return None
        slot = self.names.index(victim)
        log.info("evicting adapter %s (least recently used) from slot %d", victim[0], slot)
        del self._used[victim]
        if victim == self.draining:
            self.draining = None
        for weights in self.step.weights.values():
            weights.shrink[slot] = weights.expand[slot] = torch.empty(0, 0, dtype=self.dtype)
            weights.scale[slot] = 0.0
        self.names[slot] = None
        self.step.version += 1
        return slot

    def _install(self, slot: int, key: AdapterKey, adapter: Adapter) -> None:
        started = time.perf_counter()
        for module, delta in adapter.deltas.items():
            weights = self.step.weights[module]
            weights.shrink[slot], weights.expand[slot] = delta.shrink, delta.expand
            weights.scale[slot] = delta.scale
        self.names[slot] = key
        self._used[key] = None
        self.step.version += 1
        ranks = sorted({d.rank for d in adapter.deltas.values()})
        log.info(
            "adapter %s in slot %d: %d linears, rank %s, %.1f MiB (installed in %.1f ms)",
            *(adapter.name, slot, len(adapter.deltas), "/".join(map(str, ranks)), adapter.nbytes / 2**20),
            (time.perf_counter() - started) * 1000,
        )

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


def attach_lora(
    model: object, linears: dict[str, tuple[int, int]], slots: int, max_rank: int, dtype: torch.dtype
) -> LoraPool:
    """Wrap the model's adaptable ``linears`` (read before any fusing) and return the pool that
    fills their slots."""
    from tokenfleet.engines.native.lora.linear import wrap_linears

    step = LoraStep()
    wrap_linears(model, linears, step)
    return LoraPool(slots, max_rank, linears, dtype, step)
