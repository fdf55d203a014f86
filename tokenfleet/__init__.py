"""tokenfleet: LLM generation served by accelerator workers fed by Redis Streams."""

__version__ = "0.1.0"
