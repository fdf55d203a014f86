"""What the runner loads: a Hugging Face causal LM on its device with the paged attention function,
its tokenizer, and the KV pool its shape and the memory budget call for."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenfleet.config import KVCacheConfig
from tokenfleet.engines.native.attention import paged as attention
from tokenfleet.engines.native.kv_sizing import pool_blocks
from tokenfleet.kvcache.store import PagedKVStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """What the KV pool and the samplers need to know of a model's architecture."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
        )


def load_model(model_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The tokenizer and the model of ``model_dir``, the model on ``device`` in inference mode,
    its attention our paged function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention.register()
    )
    model = model.to(device)
    model.train(False)  # inference mode: dropout and friends off
    return tokenizer, model


@dataclass(frozen=True)
class KVPool:
    """The paged K/V store, the blocks the scheduler may hand out (one more, the scratch block
    where padding tokens' K/V go, follows them) and what one block costs."""

    store: PagedKVStore
    num_blocks: int
    bytes_per_block: int

    @property
    def scratch_block(self) -> int:
        return self.num_blocks


def kv_pool(model: Any, shape: ModelShape, kv: KVCacheConfig, max_seq_len: int) -> KVPool:
    """A pool sized by ``kv`` (a block count, a memory budget, or the default budget beside the
    weights as loaded), paging itself in on a low-priority thread so that no step waits on a fault."""
    dtype, device = model.dtype, model.device
    per_block = PagedKVStore.bytes_per_block(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, kv.block_size, dtype
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    sequence_blocks = max_seq_len // kv.block_size
    blocks = kv.num_blocks or pool_blocks(per_block, kv.memory_bytes, weights, device.type, sequence_blocks)
    store = PagedKVStore(
        shape.num_layers, blocks + 1, kv.block_size, shape.num_kv_heads, shape.head_dim, device, dtype
    )
    store.populate_in_background()
    return KVPool(store, blocks, per_block)


def finish_logits(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the model's causal-LM head does to the LM head's output before it returns logits,
    as transformers' own head does it: Gemma 2/3's final softcap, Granite's division, Cohere's
    scale (others return them as they are; the load-time probe refuses a head it does not know)."""
    cfg = config.get_text_config()
    cap = getattr(cfg, "final_logit_softcapping", None)
    divide = getattr(cfg, "logits_scaling", None) if cfg.model_type.startswith("granite") else None
    multiply = getattr(cfg, "logit_scale", None) if cfg.model_type.startswith("cohere") else None

    def finish(logits: torch.Tensor) -> torch.Tensor:
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if divide is not None:
            logits = logits / divide
        if multiply is not None:
            logits = logits * multiply
        return logits

    return finish
