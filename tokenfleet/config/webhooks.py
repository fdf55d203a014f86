"""Where the gateway may send webhooks: every endpoint's host must be on the operator's allowlist,
so that no setting (or a later per-request one) can aim the fleet at an internal address."""

from __future__ import annotations

import base64
import binascii
from urllib.parse import urlsplit


def split_list(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def checked_endpoints(urls: str | None, hosts: str | None) -> tuple[str, ...]:
    """The endpoints of ``urls``; ``ValueError`` names the first that is not an http(s) URL or
    whose host (``host`` or ``host:port``; ``*.example.com`` for its subdomains) is not allowed."""
    allowed = [host.lower() for host in split_list(hosts)]
    endpoints = tuple(split_list(urls))
    for url in endpoints:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"webhook endpoint {url!r} is not an http(s) URL")
        if not host_allowed(parts.hostname, parts.port, allowed):
            raise ValueError(f"webhook endpoint {url!r}: its host is not in --webhook-hosts")
    return endpoints


def host_allowed(host: str, port: int | None, allowed: list[str]) -> bool:
    host = host.lower()
    for entry in allowed:
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if entry_port and (port is None or str(port) != entry_port):
            continue
        if name == host or (name.startswith("*.") and host.endswith(name[1:])):
            return True
    return False


def secret_key(secret: str) -> bytes:
    """The signing key of a Standard Webhooks secret (``whsec_`` and base64, as OpenAI's)."""
    if not secret.startswith("whsec_"):
        raise ValueError(
            "the webhook secret must be whsec_ followed by base64 (e.g. from `openssl rand -base64 32`)"
        )
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except binascii.Error as e:
        raise ValueError(f"the webhook secret is not valid base64 after whsec_: {e}") from None
    if len(key) < 16:
        raise ValueError("the webhook secret is too short: at least 16 bytes, base64-encoded")
    return key
