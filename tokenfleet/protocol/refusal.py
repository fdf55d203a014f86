"""Why an entry will not run, as a value: what the worker answers with instead of generating."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.errors import ProtocolError


@dataclass(frozen=True)
class Refusal:
    """An entry that will not run: ``code`` is an :class:`~tokenfleet.protocol.ErrorCode` for the
    ``error`` reply; ``dead_letter`` when the entry also goes to the dead-letter stream (it cannot
    be answered, or it must be kept for an operator to look at)."""

    code: str
    message: str
    dead_letter: bool = False

    @classmethod
    def of(cls, error: ProtocolError) -> Refusal:
        """How the worker answers an entry that broke the wire contract."""
        return cls(error.code, error.message, error.dead_letter)
