"""Helpers shared by the benchmarks."""

from __future__ import annotations

import tempfile


def model_or_tiny(model: str | None) -> str:
    """The model directory to benchmark: the one given, else the tiny model built in a temp dir."""
    if model is not None:
        return model
    from tokenfleet.models import init_model

    return str(init_model(tempfile.mkdtemp(prefix="tokenfleet-bench-") + "/tiny", "tiny"))
