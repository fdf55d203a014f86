"""The worker: an rq-shaped loop joining the engine core (no Redis) and the transport (no torch)."""
