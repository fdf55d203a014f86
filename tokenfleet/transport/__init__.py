"""Everything Redis on the worker side: Lua scripts, intake, outbox, the per-turn round trip,
reclaiming, ownership, the fleet registry. No torch here."""
