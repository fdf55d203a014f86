"""Who may look at the dashboard and who may act on the fleet from it, and the record of every
action taken (a log line and an entry on the fleet's audit stream)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.protocol import Keys, as_text

log = logging.getLogger("tokenfleet.dashboard")
AUDIT_MAXLEN = 1000  # actions kept on the audit stream


class Refused(Exception):
    """A call that cannot be done as asked: the HTTP ``status`` to answer and why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Access:
    """``admins`` may view and act; ``viewers`` may only view; with ``open_view`` anyone may view
    (a gateway that asks no key of anyone)."""

    admins: frozenset[str]
    viewers: frozenset[str] = frozenset()
    open_view: bool = False

    def viewer(self, authorization: str | None) -> str:
        """Who is viewing (a key's fingerprint, or ``anonymous``); :class:`Refused` (401) for a
        caller without a viewer's or an admin's key where one is needed."""
        key = _bearer(authorization)
        if key is not None and self._holds(key, self.admins | self.viewers):
            return fingerprint(key)
        if self.open_view:
            return "anonymous"
        raise Refused(401, "the dashboard needs a viewer's or an admin's key (Authorization: Bearer KEY)")

    def admin(self, authorization: str | None) -> str:
        """The acting admin's fingerprint; :class:`Refused` (401/403) for anyone else."""
        if not self.admins:
            raise Refused(403, "actions are off: no admin keys are configured (--admin-keys)")
        key = _bearer(authorization)
        if key is None or not self._holds(key, self.admins | self.viewers):
            raise Refused(401, "actions need an admin key (Authorization: Bearer KEY)")
        if not self._holds(key, self.admins):
            raise Refused(403, "this key may only view: actions need an admin key")
        return fingerprint(key)

    @staticmethod
    def _holds(key: str, keys: frozenset[str]) -> bool:
        given = key.encode()  # compare_digest refuses str beyond ASCII
        return any(hmac.compare_digest(given, k.encode()) for k in keys)


def fingerprint(key: str) -> str:
    """A key as the audit names it: never the key itself."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:10]


def _bearer(authorization: str | None) -> str | None:
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return given.strip() or None


def record(
    client: redis.Redis, keys: Keys, who: str, action: str, target: str, outcome: dict[str, Any]
) -> None:
    """Log an action and keep it on the fleet's audit stream (the newest :data:`AUDIT_MAXLEN`)."""
    log.info("dashboard action %s %s by %s on fleet %s: %s", action, target, who, keys.prefix, outcome)
    entry: dict[Any, Any] = {"at": time.time(), "who": who, "action": action, "target": target}
    entry["outcome"] = json.dumps(outcome)
    client.xadd(keys.audit, entry, maxlen=AUDIT_MAXLEN, approximate=True)


def recent(client: redis.Redis, keys: Keys, count: int = 50) -> list[dict[str, Any]]:
    """The newest actions first."""
    raw: Any = client.xrevrange(keys.audit, count=count)
    rows = []
    for entry_id, fields in raw:
        row = {as_text(k): as_text(v) for k, v in fields.items()}
        rows.append({"id": as_text(entry_id), **row, "at": float(row.get("at", 0))})
    return rows
