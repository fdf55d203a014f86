"""Block allocator of the paged KV cache. Pure Python (stdlib only): no torch, no Redis.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a block
table (a list of block ids); token ``i`` of a sequence lives in slot
``table[i // block_size] * block_size + i % block_size``. "No room" is returned as a value
(``None`` / ``False``); misuse (unknown or duplicate sequence) raises ``ValueError``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    # -- queries --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_tokens_stored(self) -> int:
        return sum(self._lengths.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, reserve_blocks: int = 0) -> bool:
        """Whether a new sequence of ``num_tokens`` fits and leaves ``reserve_blocks`` free."""
        return self.blocks_needed(num_tokens) + reserve_blocks <= len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: Hashable) -> int:
        self._table(seq_id)
        return self._lengths[seq_id]

    def slot(self, seq_id: Hashable, position: int) -> int:
        """Flat slot index of token ``position`` of a sequence."""
        table = self._table(seq_id)
        if not 0 <= position < self._lengths[seq_id]:
            raise ValueError(f"position {position} is outside sequence {seq_id!r} of {self._lengths[seq_id]}")
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _table(self, seq_id: Hashable) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    # -- changes --------------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Give a new sequence blocks for ``num_tokens`` tokens; None if the pool lacks room."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        needed = self.blocks_needed(num_tokens)
        if needed > len(self._free):
            return None
        table = [self._free.popleft() for _ in range(needed)]
        self._tables[seq_id] = table
        self._lengths[seq_id] = num_tokens
        return list(table)

    def append_slot(self, seq_id: Hashable) -> int | None:
        """Make room for one more token; returns its flat slot, or None if a new block was needed
        and none is free (the caller preempts someone and retries)."""
        table = self._table(seq_id)
        length = self._lengths[seq_id]
        if length == len(table) * self.block_size:
            if not self._free:
                return None
            table.append(self._free.popleft())
        self._lengths[seq_id] = length + 1
        return table[length // self.block_size] * self.block_size + length % self.block_size

    def free(self, seq_id: Hashable) -> None:
        """Return every block of a sequence to the pool (they are reused last-freed-last)."""
        table = self._table(seq_id)
        self._free.extend(table)
        del self._tables[seq_id]
        del self._lengths[seq_id]

    # -- integrity ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless free + used == total and every block has one owner."""
        owned = [b for table in self._tables.values() for b in table]
        every = owned + list(self._free)
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)):
            raise RuntimeError(
                f"block pool corrupt: {len(owned)} owned + {len(self._free)} free != {self.num_blocks}, "
                f"or a block is owned twice / lost"
            )
        for seq_id, table in self._tables.items():
            length = self._lengths[seq_id]
            if self.blocks_needed(length) != len(table):
                raise RuntimeError(f"sequence {seq_id!r} holds {len(table)} blocks for {length} tokens")
