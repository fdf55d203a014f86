"""``tokenfleet serve``'s settings: where it listens, who may call it, how long it waits."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.config.settings import section, setting
from tokenfleet.config.webhooks import checked_endpoints, secret_key
from tokenfleet.config.worker import RedisConfig


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible gateway. It holds no state of its own: run as many as you like."""

    host: str = setting("127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    port: int = setting(8000, "Port to listen on.")
    model: str | None = setting(
        None,
        "A model directory whose tokenizer.json picks the bucket here (else workers tokenize).",
        kind="path",
    )
    api_keys: str | None = setting(
        None,
        "Comma-separated API keys; requests must send one as `Authorization: Bearer KEY` (default: "
        "none needed). Prefer the environment (TOKENFLEET_API_KEYS) to the command line.",
        kind="str",
    )
    admin_keys: str | None = setting(
        None,
        "Comma-separated admin API keys: they may also add and remove LoRA adapters at run time "
        "(/v1/load_lora_adapter; without one configured those endpoints answer 403). Prefer the "
        "environment (TOKENFLEET_ADMIN_KEYS).",
        kind="str",
    )
    tenant_keys: str | None = setting(
        None,
        "Comma-separated TENANT=KEY pairs: each key is accepted as an API key and its requests are "
        "that tenant's (a prefix cache and affinity of its own: no cache hit crosses tenants). "
        "Prefer the environment (TOKENFLEET_TENANT_KEYS).",
        kind="str",
    )
    viewer_keys: str | None = setting(
        None,
        "Comma-separated read-only keys: they may look at /dashboard and nothing else (admin keys "
        "also act there). Prefer the environment (TOKENFLEET_VIEWER_KEYS).",
        kind="str",
    )
    dashboard: bool = setting(
        True,
        "Serve the dashboard at /dashboard: viewing takes a viewer's or an admin's key (none where "
        "the gateway asks no key at all), actions an admin's.",
    )
    embed_prefix: str | None = setting(
        None,
        "Key prefix of the fleet that serves /v1/embeddings (an embedding model's workers; default: "
        "this gateway's own prefix).",
        kind="str",
    )
    embed_model: str | None = setting(
        None,
        "The embedding model's directory, whose tokenizer.json picks the bucket here (else workers "
        "tokenize).",
        kind="path",
    )
    request_timeout_s: float = setting(
        600.0, "Longest a request may take end to end; past it the worker drops it (deadline)."
    )
    default_max_tokens: int = setting(
        256, "Chat completions' max_tokens when a request gives none (completions: 16, as OpenAI)."
    )
    idempotency_ttl_s: int = setting(24 * 3600, "How long an Idempotency-Key keeps pointing at its request.")
    responses_ttl_s: int = setting(
        24 * 3600,
        "How long a stored /v1/responses response is kept (retrieve, stream again, chain with "
        "previous_response_id); at most 7 days.",
    )
    max_request_bytes: int = setting(
        8 << 20,
        "Largest request body accepted, e.g. 8MiB; a larger one is answered 413 before it is read "
        "(the Batch API's uploads: --max-file-bytes).",
        kind="size",
    )
    max_file_bytes: int = setting(64 << 20, "Largest file the Batch API accepts, e.g. 64MiB.", kind="size")
    batch_jobs: bool = setting(
        True, "Run Batch API jobs in this process too (an RQ worker thread; each job runs once)."
    )
    webhook_urls: str | None = setting(
        None,
        "Comma-separated endpoints that receive signed events (Standard Webhooks, OpenAI's shapes): "
        "response.completed/failed/cancelled/incomplete of background responses, "
        "batch.completed/failed/cancelled. Each host must be in --webhook-hosts.",
        kind="str",
    )
    webhook_hosts: str | None = setting(
        None,
        "Comma-separated hosts webhooks may go to (host, host:port, or *.example.com); an endpoint "
        "elsewhere is refused at start.",
        kind="str",
    )
    webhook_secret: str | None = setting(
        None,
        "The webhooks' signing secret, whsec_<base64> (openai-python's webhooks.unwrap takes it). "
        "Prefer the environment (TOKENFLEET_WEBHOOK_SECRET).",
        kind="str",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "Send each API request's span over OTLP/HTTP to this URL, e.g. http://collector:4318/v1/traces "
        "(needs tokenfleet[otel]); requests carry the trace to the workers either way.",
        kind="str",
    )
    redis: RedisConfig = section(RedisConfig)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1-65535, got {self.port!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        for name in ("max_request_bytes", "max_file_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.responses_ttl_s <= 7 * 24 * 3600:
            raise ValueError(f"responses_ttl_s must be in 1-604800, got {self.responses_ttl_s!r}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens!r}")
        self.tenants  # noqa: B018 (pairs that do not parse are refused here, at start)
        if self.webhook_urls:
            checked_endpoints(self.webhook_urls, self.webhook_hosts)
            if not self.webhook_secret:
                raise ValueError("webhook_urls need a webhook_secret (whsec_<base64>)")
            secret_key(self.webhook_secret)

    @property
    def keys(self) -> frozenset[str]:
        """The accepted API keys, admins' and tenants' included (empty: no key needed)."""
        keys = _split(self.api_keys) | frozenset(self.tenants)
        return keys | self.admins if keys else frozenset()

    @property
    def tenants(self) -> dict[str, str]:
        """Each tenant key's tenant."""
        tenants = {}
        for pair in _split(self.tenant_keys):
            tenant, sep, key = pair.partition("=")
            if not sep or not tenant.strip() or not key.strip():
                raise ValueError("tenant_keys must be TENANT=KEY pairs, comma-separated")
            tenants[key.strip()] = tenant.strip()
        return tenants

    @property
    def admins(self) -> frozenset[str]:
        """The keys that may also change the fleet (its adapters, the dashboard's actions)."""
        return _split(self.admin_keys)

    @property
    def webhook_endpoints(self) -> tuple[str, ...]:
        return checked_endpoints(self.webhook_urls, self.webhook_hosts)

    @property
    def viewers(self) -> frozenset[str]:
        """The keys that may only look at the dashboard."""
        return _split(self.viewer_keys)


def _split(keys: str | None) -> frozenset[str]:
    return frozenset(k.strip() for k in (keys or "").split(",") if k.strip())
