"""How large the native engine's KV pool is: what was asked for (``--num-blocks`` or
``--kv-cache-memory``), else a default that holds the model's whole context several times over
and keeps finished sequences' prefixes cached, within what the machine has free."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 4 << 30  # vLLM-CPU's usual KV space; what the default pool aims for
DEFAULT_SHARE_OF_FREE_MEMORY = 0.25  # ... but at most this share of the memory free at start-up
MIN_BLOCKS = 64


def available_memory_bytes() -> int | None:
    """Memory free for new allocations now (POSIX; None where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def pool_blocks(bytes_per_block: int, memory_bytes: int | None, weight_bytes: int, device_type: str) -> int:
    """Blocks in the pool: ``memory_bytes`` of them when given; otherwise on the CPU
    :data:`DEFAULT_KV_BYTES`, capped at :data:`DEFAULT_SHARE_OF_FREE_MEMORY` of the free memory and
    never below the weights' size; elsewhere the weights' size (the GPU path's old default)."""
    if memory_bytes is not None:
        blocks = memory_bytes // bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"KV cache budget of {memory_bytes} bytes is smaller than one block ({bytes_per_block})"
            )
        return blocks
    budget = weight_bytes
    if device_type == "cpu":
        free = available_memory_bytes()
        cap = int(free * DEFAULT_SHARE_OF_FREE_MEMORY) if free is not None else DEFAULT_KV_BYTES
        budget = max(weight_bytes, min(DEFAULT_KV_BYTES, cap))
    return max(MIN_BLOCKS, budget // bytes_per_block)
