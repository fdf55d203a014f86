"""The model runner: a Hugging Face causal LM whose attention reads and writes a paged KV cache.

The engine owns the model, the K/V store and the block allocator. It knows nothing of Redis or
of requests: callers give it sequence ids and token lists, and get next-token logits back.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from tokenfleet.config import KVCacheConfig
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.kvcache.store import PagedKVStore
from tokenfleet.worker import attention
from tokenfleet.worker.cpu_kernels import paged_decode_kernel
from tokenfleet.worker.device import select_device, select_dtype

log = logging.getLogger(__name__)

DEFAULT_KV_FRACTION_OF_WEIGHTS = 1.0  # with no budget given, a pool as large as the weights (min 64 blocks)


@dataclass(frozen=True)
class MemoryStats:
    """What the paged pool holds now, next to what a contiguous cache would have reserved."""

    blocks_total: int
    blocks_used: int
    block_size: int
    tokens_stored: int
    bytes_per_block: int

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used

    @property
    def slots_allocated(self) -> int:
        return self.blocks_used * self.block_size

    @property
    def bytes_used(self) -> int:
        return self.blocks_used * self.bytes_per_block

    def contiguous_bytes(self, batch_size: int, max_seq_len: int) -> int:
        """Bytes a cache preallocated for ``batch_size × max_seq_len`` tokens would take."""
        return batch_size * max_seq_len * self.bytes_per_block // self.block_size


class Engine:
    """Loads a model with the paged attention function and runs prefill and decode steps."""

    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        dtype: str = "auto",
        kv: KVCacheConfig | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kv = kv or KVCacheConfig()
        self.device = select_device(device)
        self.dtype = select_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, attn_implementation=attention.register()
        ).to(self.device)
        self.model.train(False)  # inference mode: dropout and friends off
        cfg = self.model.config.get_text_config()
        num_heads = cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.vocab_size = cfg.vocab_size
        self.block_size = kv.block_size
        self.bytes_per_block = PagedKVStore.bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, kv.block_size, self.dtype
        )
        num_blocks = kv.num_blocks or self._blocks_for_budget(kv.memory_bytes)
        self.store = PagedKVStore(
            self.num_layers,
            num_blocks,
            kv.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.device,
            self.dtype,
        )
        self.allocator = BlockAllocator(num_blocks, kv.block_size)
        # decode attention straight from the pool on CPU; elsewhere (and without a compiler) the
        # blocks are gathered and SDPA runs on the copy
        self.decode_kernel = paged_decode_kernel() if self.device.type == "cpu" else None
        self.eos_token_ids = self._eos_ids()
        self.max_token_chars = self._max_token_chars()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        log.info(
            "engine: %s on %s/%s, KV pool %d blocks x %d tokens (%.1f MiB)",
            model_dir,
            self.device,
            str(self.dtype).removeprefix("torch."),
            num_blocks,
            kv.block_size,
            self.store.nbytes / 2**20,
        )

    def _blocks_for_budget(self, memory_bytes: int | None) -> int:
        if memory_bytes is None:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            memory_bytes = int(weights * DEFAULT_KV_FRACTION_OF_WEIGHTS)
            return max(64, memory_bytes // self.bytes_per_block)
        blocks = memory_bytes // self.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"KV cache budget of {memory_bytes} bytes is smaller than one block ({self.bytes_per_block})"
            )
        return blocks

    def _max_token_chars(self) -> int:
        """Most characters one token decodes to (bounds a prompt's length from its token count)."""
        vocab = self.tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=1)
        return max(1, longest + 1)  # +1: byte-level markers and word-boundary spaces

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if not ids and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- memory ---------------------------------------------------------------------------------

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            blocks_total=self.allocator.num_blocks,
            blocks_used=self.allocator.num_used_blocks,
            block_size=self.block_size,
            tokens_stored=self.allocator.num_tokens_stored,
            bytes_per_block=self.bytes_per_block,
        )

    # -- forward passes -------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()

    @torch.inference_mode()
    def prefill(self, seq_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run whole sequences (blocks already allocated for every token) padded to the longest;
        write their K/V into the pool; return next-token logits ``[B, vocab]`` (float32)."""
        lengths = [len(t) for t in token_lists]
        batch, width = len(token_lists), max(lengths)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        write_index, blocks, offsets = [], [], []
        for row, (seq_id, tokens) in enumerate(zip(seq_ids, token_lists)):
            input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            table = self.allocator.block_table(seq_id)
            for pos in range(len(tokens)):
                write_index.append(row * width + pos)
                blocks.append(table[pos // self.block_size])
                offsets.append(pos % self.block_size)
        dev = self.device
        length_t = torch.tensor(lengths, device=dev)
        positions = torch.arange(width, device=dev)
        causal = positions[None, :] <= positions[:, None]  # [T, T]: query row sees keys up to itself
        valid_key = positions[None, :] < length_t[:, None]  # [B, T]
        mask = (causal[None] & valid_key[:, None, :])[:, None]  # [B, 1, T, T]
        meta = attention.StepMetadata(
            store=self.store,
            is_prefill=True,
            write_blocks=torch.tensor(blocks, device=dev),
            write_offsets=torch.tensor(offsets, device=dev),
            mask=mask,
            write_index=torch.tensor(write_index, device=dev),
        )
        hidden = self._forward(input_ids.to(dev), positions.expand(batch, width), meta)
        last = hidden[torch.arange(batch, device=dev), length_t - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, seq_ids: Sequence[Hashable], last_tokens: Sequence[int]) -> torch.Tensor:
        """One step for sequences whose newest token is not yet in the cache (its slot already
        appended); returns next-token logits ``[B, vocab]`` (float32)."""
        tables = [self.allocator.block_table(s) for s in seq_ids]
        lengths = [self.allocator.num_tokens(s) for s in seq_ids]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        blocks = [t[(n - 1) // self.block_size] for t, n in zip(tables, lengths)]
        offsets = [(n - 1) % self.block_size for n in lengths]
        dev = self.device
        length_t = torch.tensor(lengths, device=dev)
        if self.decode_kernel is None:
            key_pos = torch.arange(width * self.block_size, device=dev)
            mask = (key_pos[None, :] < length_t[:, None])[:, None, None, :]
        else:
            mask = None  # the kernel stops at each sequence's length
        meta = attention.StepMetadata(
            store=self.store,
            is_prefill=False,
            write_blocks=torch.tensor(blocks, device=dev),
            write_offsets=torch.tensor(offsets, device=dev),
            mask=mask,
            block_tables=torch.tensor(padded, device=dev),
            lengths=length_t,
            kernel=self.decode_kernel,
        )
        input_ids = torch.tensor(last_tokens, dtype=torch.long, device=dev)[:, None]
        hidden = self._forward(input_ids, (length_t - 1)[:, None], meta)
        return self._logits(hidden[:, -1])

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: attention.StepMetadata
    ) -> torch.Tensor:
        out = self.model.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, tokenfleet_step=meta
        )
        return out.last_hidden_state
