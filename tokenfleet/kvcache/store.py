"""Torch storage of the paged KV cache: one K and one V tensor per layer, indexed by block id.

Layout ``[num_blocks, block_size, kv_heads, head_dim]`` (token-major): a step's new K/V rows go in
without a transpose, a token's heads are one contiguous row (the CPU decode kernel streams them in
order), and one ``index_select`` of a sequence's blocks is already its keys in token order (the
gather fallback reads them through a transposed view: one copy, not two).
"""

from __future__ import annotations

import torch


class PagedKVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """K and V of every layer for one block of tokens."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * block_size * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def gather(
        k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of each sequence in ``block_tables`` ``[B, max_blocks]``, read from one layer's pool
        tensors ``[blocks, block, kv_heads, head_dim]``, as ``[B, kv_heads, max_blocks * block_size,
        head_dim]``: one copy each, returned as transposed views (slots past a sequence's length
        hold stale data: mask them)."""
        batch, nblocks = block_tables.shape
        _, block_size, kv_heads, head_dim = k_cache.shape
        flat = block_tables.reshape(-1)

        def take(store: torch.Tensor) -> torch.Tensor:
            tokens = store.index_select(0, flat).view(batch, nblocks * block_size, kv_heads, head_dim)
            return tokens.transpose(1, 2)

        return take(k_cache), take(v_cache)
