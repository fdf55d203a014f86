"""`tokenfleet serve`: OpenAI's HTTP API over tokenfleet's protocol and reply streams. Stateless:
everything lives in Redis, so any number of replicas serve behind a load balancer."""
