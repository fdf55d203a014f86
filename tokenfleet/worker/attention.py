"""The paged attention function that Hugging Face models call instead of their own.

Registered with transformers' ``AttentionInterface`` under :data:`PAGED_ATTENTION`; a model
loaded with ``attn_implementation=PAGED_ATTENTION`` calls :func:`paged_attention` in every layer
with the already-rotated query/key/value. The engine passes a :class:`StepMetadata` as the
``tokenfleet_step`` keyword of the model's forward; transformers hands it through untouched.
Without it (e.g. ``model.generate``) the function falls back to plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenfleet.kvcache.store import PagedKVStore

PAGED_ATTENTION = "tokenfleet_paged"


@dataclass
class StepMetadata:
    """Where this step's K/V go in the store and which keys each query may see.

    ``write_index`` selects the real (non-pad) tokens among the ``B*T`` flattened ones (None: all);
    ``write_blocks``/``write_offsets`` are their places in the store. In prefill, attention runs over
    the step's own keys under ``mask`` ``[B, 1, T, T]``; in decode, over the keys gathered through
    ``block_tables`` ``[B, max_blocks]`` under ``mask`` ``[B, 1, 1, max_blocks * block_size]``, or,
    with ``kernel``, in place in the pool up to ``lengths`` (no gather, no mask).
    """

    store: PagedKVStore
    is_prefill: bool
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    mask: torch.Tensor | None
    write_index: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # decode: tokens each sequence attends to
    kernel: Any = None  # decode: the CPU paged kernel (reads the pool in place), None: gather + SDPA


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tokenfleet_step: StepMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if tokenfleet_step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    meta = tokenfleet_step
    layer = module.layer_idx
    batch, kv_heads, steps, head_dim = key.shape
    new_k = key.transpose(1, 2).reshape(batch * steps, kv_heads, head_dim)
    new_v = value.transpose(1, 2).reshape(batch * steps, kv_heads, head_dim)
    if meta.write_index is not None:
        new_k, new_v = new_k.index_select(0, meta.write_index), new_v.index_select(0, meta.write_index)
    meta.store.write(layer, meta.write_blocks, meta.write_offsets, new_k, new_v)
    if meta.kernel is not None and not meta.is_prefill:
        scale = scaling if scaling is not None else head_dim**-0.5
        out = meta.kernel.paged_decode_attention(
            query[:, :, 0], meta.store.k[layer], meta.store.v[layer], meta.block_tables, meta.lengths, scale
        )
        return out[:, None], None  # [B, 1, heads, head_dim]
    if meta.is_prefill:
        keys, values = key, value
    else:
        keys, values = meta.store.gather(layer, meta.block_tables)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=meta.mask, scale=scaling, enable_gqa=kv_heads != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make :data:`PAGED_ATTENTION` known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    return PAGED_ATTENTION
