"""Linear routes timed against each other at start-up, so the worker picks the faster one on the
host it runs on instead of the one it was tuned on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

Layer = Callable[[torch.Tensor], torch.Tensor]


def race_routes(
    routes: Mapping[str, Sequence[Layer]], decode_x: torch.Tensor, prefill_x: torch.Tensor, rounds: int
) -> dict[str, tuple[float, float]]:
    """Route name -> (seconds per layer on ``decode_x`` through all its layers in turn, seconds on
    ``prefill_x`` through its first), each the best of ``rounds``. The routes take turns within a
    round so that a shared host's drift hits them all alike."""

    def seconds(layers: Sequence[Layer], x: torch.Tensor) -> float:
        start = time.perf_counter()
        for layer in layers:
            layer(x)
        return (time.perf_counter() - start) / len(layers)

    with torch.inference_mode():
        for layers in routes.values():  # libraries pick and prepare their kernel on the first call
            seconds(layers, decode_x), seconds(layers[:1], prefill_x)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in routes}
        for _ in range(rounds):
            for name, layers in routes.items():
                times[name].append((seconds(layers, decode_x), seconds(layers[:1], prefill_x)))
    return {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in times.items()}
