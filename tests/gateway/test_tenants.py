"""Tenants, first part: a tenant per API key (``--tenant-keys``), its requests named on the wire,
and prefix caches kept apart: one prompt sent by two tenants is a cache hit for neither the
second time round but its own (the cached-token count the gateway reports says so)."""

from __future__ import annotations

import pytest
from test_gateway import BATCHING, MODEL

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol import validate_request
from tokenfleet.protocol.affinity import shard_of

pytestmark = pytest.mark.integration
PROMPT = "a shared system prompt that two teams both happen to send, word for word, to one fleet"[:60]


def cached(client) -> int:
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_no_prefix_cache_hit_crosses_tenants(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        gateway = gateways("--tenant-keys", "team-a=key-a,team-b=key-b", "--api-keys", "key-plain")
        a, b, plain = (gateway.openai(api_key=key) for key in ("key-a", "key-b", "key-plain"))
        first_a, again_a = cached(a), cached(a)
        first_b, again_b = cached(b), cached(b)
        first_plain = cached(plain)
    assert first_a == 0 and again_a >= 32  # within a tenant, hits work as before
    assert first_b == 0 and again_b >= 32  # team-a's blocks were there: team-b did not see them
    assert first_plain == 0  # nor does a key without a tenant


def test_a_tenant_is_a_wire_field_with_its_own_version_and_affinity():
    body = {"id": "r-1", "prompt": PROMPT, "cache_key": "conversation-1"}
    request = validate_request({**body, "tenant": "team-a"})
    assert request.tenant == "team-a" and request.to_wire()["v"] == 5  # older workers refuse it
    shards = {shard_of({**body, "tenant": f"team-{i}"}) for i in range(12)}
    assert len(shards) > 1  # one conversation key, salted per tenant: not one shard for all
    with pytest.raises(ProtocolError, match="tenant"):
        validate_request({**body, "tenant": "-bad name"})
