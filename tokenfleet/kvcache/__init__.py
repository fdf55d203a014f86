"""Paged KV cache: a pure block allocator and the torch storage it indexes."""

from tokenfleet.kvcache.allocator import BlockAllocator

__all__ = ["BlockAllocator"]
