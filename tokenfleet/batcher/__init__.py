"""Batch formation: buckets, lanes and the static/dynamic/continuous dispatch rules (pure)."""

from tokenfleet.batcher.batcher import Batch, Batcher, PendingRequest

__all__ = ["Batch", "Batcher", "PendingRequest"]
