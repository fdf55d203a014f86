"""The model's linears with LoRA updates beside them: after the base product of the whole batch
(on whatever route the linear took), each row's adapter adds its low-rank update, rows grouped by
adapter, in one kernel call per linear (``tokenfleet::lora_delta_``, Punica's SGMV on the CPU).
A fused linear (the lean forward's q/k/v and gate/up) carries the updates of the linears it
joined, each at its columns. Rows without an adapter, and steps without one, cost one check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class SlotWeights:
    """One linear's update in each slot (an empty ``shrink``: the adapter there leaves it alone)."""

    shrink: list[torch.Tensor]
    expand: list[torch.Tensor]
    scale: list[float]

    @classmethod
    def empty(cls, slots: int, dtype: torch.dtype) -> SlotWeights:
        none = torch.empty(0, 0, dtype=dtype)
        return cls([none] * slots, [none] * slots, [0.0] * slots)


@dataclass
class LoraStep:
    """What the step running now asks of the adapted linears: each token row's slot (-1: the
    base model), or None when no row of the step has an adapter."""

    rows: torch.Tensor | None = None
    weights: dict[str, SlotWeights] = field(default_factory=dict)  # by the adapted linear's name
    version: int = 0  # moved on whenever a slot's weights change (what the linears' lists follow)


class LoraLinear(nn.Module):
    """``base``, then the updates of the adapted linears it computes: ``parts`` holds each one's
    name (its module path in the model) and where its output starts in ``base``'s."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], step: LoraStep):
        super().__init__()
        self.base = base
        self.parts = parts
        self.step = step
        self.offsets = [offset for _, offset in parts]
        self._lists: tuple[int, list[torch.Tensor], list[torch.Tensor], list[float]] | None = None

    def forward(self, x: torch.Tensor) -> Any:
        y = self.base(x)
        rows = self.step.rows
        if rows is None:
            return y
        _, shrink, expand, scale = self._slot_lists()
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        # every part in one call: one parallel region for them all
        torch.ops.tokenfleet.lora_delta_(y2, x2, shrink, expand, scale, rows, self.offsets)
        return y

    def _slot_lists(self) -> tuple[int, list[torch.Tensor], list[torch.Tensor], list[float]]:
        """Each part's slot weights in one list (part by part), built again only after a slot
        changed: a decode step calls this linear for every layer."""
        if self._lists is None or self._lists[0] != self.step.version:
            weights = [self.step.weights[name] for name, _ in self.parts]
            self._lists = (
                self.step.version,
                [t for w in weights for t in w.shrink],
                [t for w in weights for t in w.expand],
                [c for w in weights for c in w.scale],
            )
        return self._lists


def adaptable_linears(model: Any) -> dict[str, tuple[int, int]]:
    """Every linear of the model's decoder layers, by module path: (in_features, out_features)."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        return {}
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return {
        f"{prefix}.{name}": (module.in_features, module.out_features)
        for name, module in layers.named_modules()
        if isinstance(module, nn.Linear)
    }


def wrap_linears(model: Any, linears: dict[str, tuple[int, int]], step: LoraStep) -> int:
    """Put a :class:`LoraLinear` around each module that computes one of ``linears`` (under its own
    name, or fused: ``qkv_proj`` for ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` for
    ``gate_proj``/``up_proj``, at their columns); returns how many were wrapped."""
    modules = dict(model.named_modules())
    fused: dict[str, list[tuple[str, int]]] = {}
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        if name in modules:
            fused.setdefault(name, []).append((name, 0))
            continue
        group = FUSED.get(leaf)
        if group is None:
            raise ValueError(f"the model's linear {name} is neither there nor fused")
        joined, members = group
        offset = sum(linears[f"{parent}.{m}"][1] for m in members[: members.index(leaf)])
        fused.setdefault(f"{parent}.{joined}", []).append((name, offset))
    for path, parts in fused.items():
        parent, _, leaf = path.rpartition(".")
        owner = modules[parent] if parent else model
        setattr(owner, leaf, LoraLinear(getattr(owner, leaf), parts, step))
    return len(fused)


# the lean forward's fused projections: (fused name, the linears it joined, in column order)
FUSED = {
    member: (name, members)
    for name, members in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    )
    for member in members
}
