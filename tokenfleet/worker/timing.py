"""Where a worker's time went: reading work, model steps, other Redis round trips."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TimeSpent:
    """Where a worker's time went, logged when it stops."""

    intake_s: float = 0.0  # waiting for and reading work (the part a step did not hide)
    step_s: float = 0.0  # model steps
    redis_s: float = 0.0  # other Redis round trips

    def add_turn(self, exchange_s: float | None, step_s: float, turn_s: float) -> None:
        """A turn of ``turn_s`` seconds: its exchange before the step (None: it overlapped the
        step, and the Redis time the step did not hide counts as intake), its step, the rest."""
        self.step_s += step_s
        if exchange_s is None:
            self.intake_s += turn_s - step_s
        else:
            self.intake_s += exchange_s
            self.redis_s += turn_s - exchange_s - step_s

    def __str__(self) -> str:
        return (
            f"{self.intake_s:.2f}s reading/waiting for work, {self.step_s:.2f}s in model steps, "
            f"{self.redis_s:.2f}s in other Redis round trips"
        )
