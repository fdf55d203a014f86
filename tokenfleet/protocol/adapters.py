"""The fleet's adapter registry entries (``{P}:adapters``, docs/PROTOCOL.md "Adapters"): a LoRA
adapter's name, the directory it lies in on every worker that serves its base model, and that
base's served name. Requests name an adapter; workers find its directory here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol.constants import MAX_ADAPTER_NAME_LEN, ErrorCode


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    path: str
    base: str | None = None  # the model it was trained on (served name); None: any the worker serves

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "base": self.base})

    @classmethod
    def from_json(cls, name: str, raw: str | bytes) -> AdapterRecord:
        """An entry of the hash; :class:`ProtocolError` where it is not one."""
        try:
            body: Any = json.loads(raw)
            path, base = body["path"], body.get("base")
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(
                ErrorCode.ADAPTER_UNAVAILABLE, f"adapter {name!r}: unreadable record: {e}"
            ) from e
        if not isinstance(path, str) or not (base is None or isinstance(base, str)):
            raise ProtocolError(
                ErrorCode.ADAPTER_UNAVAILABLE, f"adapter {name!r}: path and base must be strings"
            )
        return cls(name, path, base)


def check_adapter_name(name: str) -> str:
    """``name`` if it is a valid adapter name, else ``ValueError`` saying what one is."""
    from tokenfleet.protocol.validation import valid_adapter_name

    if not valid_adapter_name(name):
        raise ValueError(
            f"adapter names are 1-{MAX_ADAPTER_NAME_LEN} characters from [A-Za-z0-9._:/-], "
            f"starting with a letter or digit; got {name!r}"
        )
    return name
