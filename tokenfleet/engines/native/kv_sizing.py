"""How large the native engine's KV pool is: what was asked for (``--num-blocks`` or
``--kv-cache-memory``), else a default large enough to keep many conversations' prefixes cached,
within what the machine has free."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 1 << 30  # SmolLM2-135M in bf16: 45k tokens; a 1B Llama: 32k
DEFAULT_SHARE_OF_FREE_MEMORY = 0.25  # ... but at most this share of the memory free at start-up
MIN_BLOCKS = 64


def available_memory_bytes() -> int | None:
    """Memory free for new allocations now (POSIX; None where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def pool_blocks(
    bytes_per_block: int,
    memory_bytes: int | None,
    weight_bytes: int,
    device_type: str,
    sequence_blocks: int = 0,
) -> int:
    """Blocks in the pool: ``memory_bytes`` of them when given; otherwise on the CPU the larger of
    :data:`DEFAULT_KV_BYTES` and the weights' size, capped at :data:`DEFAULT_SHARE_OF_FREE_MEMORY`
    of the free memory; elsewhere the weights' size. Logs a warning where the pool cannot hold
    ``sequence_blocks`` (a ``max_seq_len`` sequence): longer requests are refused."""
    blocks = _blocks(bytes_per_block, memory_bytes, weight_bytes, device_type)
    if blocks < sequence_blocks:
        log.warning(
            "the KV pool holds %d blocks, fewer than a max_seq_len sequence takes (%d): longer requests "
            "get cache_too_small (--kv-cache-memory sets the pool)",
            blocks,
            sequence_blocks,
        )
    return blocks


def _blocks(bytes_per_block: int, memory_bytes: int | None, weight_bytes: int, device_type: str) -> int:
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
        budget = min(max(weight_bytes, DEFAULT_KV_BYTES), cap)
    return max(MIN_BLOCKS, budget // bytes_per_block)
