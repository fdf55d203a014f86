"""Where the gateway may send webhooks: every endpoint's host must be on the operator's allowlist,
so that no setting (or a later per-request one) can aim the fleet at an internal address."""

from __future__ import annotations

import base64
import binascii
from urllib.parse import urlsplit


def split_list(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


DEFAULT_PORTS = {"http": 80, "https": 443}


def checked_endpoints(urls: str | None, hosts: str | None) -> tuple[str, ...]:
    """The endpoints of ``urls``; ``ValueError`` names the first that is not a plain http(s) URL
    or whose host (``host`` or ``host:port``; ``*.example.com`` for its subdomains) is not allowed."""
    allowed = [_host_port(entry) for entry in split_list(hosts)]
    endpoints = tuple(split_list(urls))
    for url in endpoints:
        parts = urlsplit(url)
        # urlsplit drops tabs and newlines and keeps a backslash in the host, where a WHATWG
        # parser ends the host: the client could go elsewhere than the check saw
        if any(ord(c) <= 32 or ord(c) == 127 or c == "\\" for c in url):
            raise ValueError(f"webhook endpoint {url!r} holds whitespace, control characters or a backslash")
        if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.username or parts.password:
            raise ValueError(f"webhook endpoint {url!r} is not an http(s) URL (without credentials)")
        port = parts.port or DEFAULT_PORTS[parts.scheme]
        if not any(host_allowed(parts.hostname, port, name, entry_port) for name, entry_port in allowed):
            raise ValueError(f"webhook endpoint {url!r}: its host is not in --webhook-hosts")
    return endpoints


def _host_port(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]:port`` or ``*.domain`` as (lowercase host, port or None)."""
    parts = urlsplit("//" + entry.strip())
    if parts.hostname is None:
        raise ValueError(f"--webhook-hosts entry {entry!r} is not a host")
    name = "*." + parts.hostname[2:] if entry.strip().startswith("*.") else parts.hostname
    return name.lower(), parts.port


def host_allowed(host: str, port: int, name: str, entry_port: int | None) -> bool:
    """Whether ``host:port`` is the allowlist entry ``name`` (port ``entry_port``, any if None)."""
    if entry_port is not None and entry_port != port:
        return False
    host = host.lower()
    return name == host or (name.startswith("*.") and host.endswith(name[1:]))


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
