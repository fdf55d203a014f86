"""Webhooks: events in OpenAI's shapes, signed per Standard Webhooks (``events``), kept and leased
in Redis (``outbox``), delivered at least once with backoff by any gateway replica
(``delivery``); background responses followed to their end to raise theirs (``watch``)."""
