"""Block allocator of the paged KV cache, with automatic prefix caching. Pure Python (stdlib only).

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a block
table (a list of block ids); token ``i`` of a sequence lives in slot
``table[i // block_size] * block_size + i % block_size``. "No room" is returned as a value
(``None`` / ``False``); misuse (unknown or duplicate sequence) raises ``ValueError``.

Prefix caching (as vLLM's ``v1/core/block_pool.py``): a full block is named by a hash chained over
its parent's hash and its own token ids, so equal names mean equal tokens at equal positions, and
equal K/V. The pool keeps name -> block for full blocks and a reference count per block; a block
no sequence holds stays named, on the free list (least recently used first), until the pool
hands it out again. A new sequence takes the longest chain of named blocks its tokens begin with
(shared, never written again: a sequence writes only its own blocks past them) and new blocks for
the rest. Blocks named in one step are read by sequences of that same step only after the step
writes them (the engine writes a layer's K/V before it attends); a step that fails forgets them
(:meth:`forget_unconfirmed`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

ROOT = b"tokenfleet-kv-v1"  # the parent of a sequence's first block
MEMO_SEQUENCES = 256  # token sequences whose block names are kept (waiting requests ask each step)


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's name: its parent's name and its token ids (16-byte BLAKE2b: collisions are
    not a practical concern, unlike Python's 64-bit ``hash``)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def salted_root(salt: bytes) -> bytes:
    """The parent name of a sequence's first block when its K/V depend on more than its tokens."""
    return hashlib.blake2b(ROOT + b"salt:" + salt, digest_size=16).digest()


def chain_hashes(tokens: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The names of every full block of ``tokens``, in order."""
    names = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        names.append(parent)
    return names


@dataclass(frozen=True)
class Allocation:
    """A new sequence's blocks, and how many of its first tokens those blocks already hold."""

    table: list[int]
    cached_tokens: int


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first out: first
        self._refs = [0] * num_blocks
        self._name: list[bytes | None] = [None] * num_blocks  # set iff _named[_name[b]] == b
        self._named: dict[bytes, int] = {}
        self._unconfirmed: list[int] = []  # named this step, not yet written
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._chains: dict[Hashable, list[bytes]] = {}  # names of the sequence's full blocks
        self._roots: dict[Hashable, bytes] = {}  # the parent of its first block (its salt's root)
        self._tail: dict[Hashable, list[int]] = {}  # token ids in its last, partial block
        self.queries = 0  # prompt tokens looked up in the cache
        self.hits = 0  # ... found there
        self._memo: OrderedDict[tuple[tuple[int, ...], bytes], list[bytes]] = OrderedDict()

    # -- queries --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (named ones among them, reused last)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Named blocks: held or not, a later sequence that begins with their tokens reuses them."""
        return len(self._named)

    @property
    def num_tokens_stored(self) -> int:
        return sum(self._lengths.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, tokens: Sequence[int], salt: bytes = b"") -> list[int]:
        """The named blocks ``tokens`` begin with, at most all but the last token's (that one is
        computed: its logits start the generation). ``salt``: what else their K/V depend on (an
        adapter); blocks named under another salt are never found."""
        if not self.prefix_caching or len(tokens) < 2:
            return []
        found = []
        for name in self._names(tokens, salt)[: (len(tokens) - 1) // self.block_size]:
            block = self._named.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def blocks_to_take(self, tokens: Sequence[int], extra_tokens: int = 0, salt: bytes = b"") -> int:
        """Blocks a new sequence of ``tokens`` (and room for ``extra_tokens`` more) would take off
        the free list: its new blocks, and the cached ones it reuses that no one holds."""
        cached = self.cached_prefix(tokens, salt)
        new = self.blocks_needed(len(tokens) + extra_tokens) - len(cached)
        return new + sum(self._refs[b] == 0 for b in cached)

    def can_allocate(
        self, tokens: Sequence[int], reserve_blocks: int = 0, extra_tokens: int = 1, salt: bytes = b""
    ) -> bool:
        """Whether a new sequence of ``tokens`` fits with room for ``extra_tokens`` more and leaves
        ``reserve_blocks`` free."""
        return self.blocks_to_take(tokens, extra_tokens, salt) + reserve_blocks <= len(self._free)

    def blocks_freed_by(self, seq_id: Hashable) -> int:
        """Blocks that would return to the free list if ``seq_id`` were freed (not those shared)."""
        return sum(self._refs[b] == 1 for b in self._table(seq_id))

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

    def allocate(
        self, seq_id: Hashable, tokens: Sequence[int], salt: bytes = b"", cache: bool = True
    ) -> Allocation | None:
        """Blocks for a new sequence of ``tokens``: the cached blocks it begins with, shared, and
        new ones for the rest (those it fills are named at once, under ``salt``); None if the
        pool lacks room. ``cache=False``: new blocks, never named (every token computed, read once)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if len(tokens) < 1:
            raise ValueError("a sequence needs at least one token")
        cached = self.cached_prefix(tokens, salt) if cache else []
        new = self.blocks_needed(len(tokens)) - len(cached)
        if new + sum(self._refs[b] == 0 for b in cached) > len(self._free):
            return None
        for block in cached:
            self._hold(block)
        table = cached + [self._take_free() for _ in range(new)]
        self._tables[seq_id] = table
        self._lengths[seq_id] = len(tokens)
        full = len(tokens) // self.block_size
        named = self.prefix_caching and cache
        chain = list(self._names(tokens, salt)) if named else []
        self._chains[seq_id], self._roots[seq_id] = chain, salted_root(salt) if salt else ROOT
        self._tail[seq_id] = list(tokens[full * self.block_size :])
        for i in range(len(cached), len(chain)):
            self._name_block(table[i], chain[i])
        if named:
            self.queries += len(tokens)
            self.hits += len(cached) * self.block_size
        return Allocation(list(table), len(cached) * self.block_size)

    def append_slot(self, seq_id: Hashable, token_id: int) -> int | None:
        """Make room for one more token (``token_id``, written by the coming step); returns its flat
        slot, or None if a new block was needed and none is free (the caller preempts someone and
        retries). A block this token fills is named."""
        table = self._table(seq_id)
        length = self._lengths[seq_id]
        if length == len(table) * self.block_size:
            if not self._free:
                return None
            table.append(self._take_free())
        self._lengths[seq_id] = length + 1
        tail = self._tail[seq_id]
        tail.append(token_id)
        if len(tail) == self.block_size:
            if self.prefix_caching:
                chain = self._chains[seq_id]
                name = block_hash(chain[-1] if chain else self._roots[seq_id], tail)
                chain.append(name)
                self._name_block(table[-1], name)
            tail.clear()
        return table[length // self.block_size] * self.block_size + length % self.block_size

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks: those no one else holds go to the free list, named ones to
        its end (its last blocks before its first: a prefix outlives its continuations), the rest
        to its front (reused first)."""
        table = self._table(seq_id)
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._name[block] is None:
                    self._free.move_to_end(block, last=False)
        for mapping in (self._tables, self._lengths, self._chains, self._roots, self._tail):
            del mapping[seq_id]

    def confirm(self) -> None:
        """The step that writes the blocks named since the last call ran: they may be shared."""
        self._unconfirmed.clear()

    def forget_unconfirmed(self) -> None:
        """The step that was to write the blocks named since :meth:`confirm` failed: unname them
        (they hold no K/V); their sequences are aborted by the caller."""
        for block in self._unconfirmed:
            self._unname(block)
        self._unconfirmed.clear()

    def _names(self, tokens: Sequence[int], salt: bytes) -> list[bytes]:
        """The names of ``tokens``' full blocks under ``salt``, remembered for the last
        :data:`MEMO_SEQUENCES` sequences asked about (a request waiting for room is asked about at
        every step)."""
        key = (tuple(tokens), salt)
        names = self._memo.get(key)
        if names is None:
            root = salted_root(salt) if salt else ROOT
            names = self._memo[key] = chain_hashes(key[0], self.block_size, root)
            if len(self._memo) > MEMO_SEQUENCES:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return names

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _take_free(self) -> int:
        """The free block reused first, its name (if any) dropped: the pool needs it."""
        block, _ = self._free.popitem(last=False)
        self._unname(block)
        self._refs[block] = 1
        return block

    def _name_block(self, block: int, name: bytes) -> None:
        """Name a block its sequence has filled, unless another block has that name already (then
        this one stays unnamed: two copies of one prefix, the first kept)."""
        if self.prefix_caching and name not in self._named and self._name[block] is None:
            self._named[name] = block
            self._name[block] = name
            self._unconfirmed.append(block)

    def _unname(self, block: int) -> None:
        name = self._name[block]
        if name is not None:
            del self._named[name]
            self._name[block] = None

    # -- integrity ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless every block is free or held, each held block's count is
        the tables that hold it, the free list is exactly the blocks no one holds, and the names
        and blocks map one to one."""
        holders = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise RuntimeError(f"sequence {seq_id!r} holds a block twice")
            length = self._lengths[seq_id]
            if self.blocks_needed(length) != len(table):
                raise RuntimeError(f"sequence {seq_id!r} holds {len(table)} blocks for {length} tokens")
            for block in table:
                holders[block] += 1
        if holders != self._refs:
            raise RuntimeError("block pool corrupt: reference counts differ from the tables")
        if set(self._free) != {b for b in range(self.num_blocks) if holders[b] == 0}:
            raise RuntimeError("block pool corrupt: the free list is not the blocks no one holds")
        named = sum(name is not None for name in self._name)
        if named != len(self._named) or any(self._name[b] != name for name, b in self._named.items()):
            raise RuntimeError("block pool corrupt: block names and the name map disagree")
