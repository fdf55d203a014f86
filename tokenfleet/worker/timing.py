"""Where a worker's time went: reading work, model steps, other Redis round trips."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TimeSpent:
    """Where a worker's time went, logged when it stops."""

    intake_s: float = 0.0  # waiting for and reading work (the part a step did not hide)
    step_s: float = 0.0  # model steps
    redis_s: float = 0.0  # other Redis round trips

    def __str__(self) -> str:
        return (
            f"{self.intake_s:.2f}s reading/waiting for work, {self.step_s:.2f}s in model steps, "
            f"{self.redis_s:.2f}s in other Redis round trips"
        )
