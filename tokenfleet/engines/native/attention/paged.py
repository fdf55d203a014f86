"""The paged attention function that Hugging Face models call instead of their own.

Registered with transformers' ``AttentionInterface`` under :data:`PAGED_ATTENTION`; a model
loaded with ``attn_implementation=PAGED_ATTENTION`` calls :func:`paged_attention` in every layer
with the already-rotated query/key/value. The engine passes a :class:`StepMetadata` as the
``tokenfleet_step`` keyword of the model's forward; transformers hands it through untouched.
Without it (e.g. ``model.generate``) the function falls back to plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfleet.kvcache.store import PagedKVStore

PAGED_ATTENTION = "tokenfleet_paged"


@dataclass
class PrefillGroups:
    """Prompts of similar lengths padded into one SDPA call each (see :func:`length_groups`).
    Group ``g`` is ``shape[3g : 3g + 3]`` = (rows, tokens, width); ``index`` holds, group after
    group, its rows, each token's place in the packed step, and its place in the group's
    ``[rows, width]`` padding. Computed once per step on the host, read by every layer."""

    index: torch.Tensor
    shape: list[int]


@dataclass
class StepMetadata:
    """Where this step's K/V go in the store and which keys each query may see.

    Every one of the step's tokens is written at pool slot ``slots`` (block x block_size +
    offset), or for the C++ kernels at ``write_blocks``, ``write_offsets``; the padding rows of
    a padded batch go to the store's scratch block. Prefill is packed: the model sees the prompts
    laid end to end (``[1, N]``: no padding in the matmuls), and attention scatters prompts of
    similar lengths into padded rows (``groups``) to run under their part of ``mask``
    ``[B, 1, L, L]``, then packs the result back; or, with ``use_kernel``, the C++ operator
    ``tokenfleet::paged_prefill`` attends on the packed tokens themselves (prompt ``b`` is tokens
    ``starts[b] .. starts[b + 1]``) and does the write. Where prompts begin with a cached prefix,
    prefill also has ``block_tables`` and ``cached`` (the kernel reads those tokens' K/V from the
    pool) and ``context`` (the same on the host, for the SDPA route's prompt-by-prompt path).
    Decode attends to each sequence's
    ``lengths`` keys found through ``block_tables`` ``[B, max_blocks]``: read in place by the C++
    operator ``tokenfleet::paged_decode`` (``use_kernel``) or the Triton kernel (``use_triton``),
    or gathered and masked by ``mask`` ``[B, 1, 1, max_blocks * block_size]``.
    """

    store: PagedKVStore
    is_prefill: bool
    slots: torch.Tensor | None = None
    write_blocks: torch.Tensor | None = None
    write_offsets: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    groups: PrefillGroups | None = None
    use_kernel: bool = False
    use_triton: bool = False
    cached: torch.Tensor | None = None  # prefill: tokens each prompt has in the pool (C++ kernel)
    context: tuple[list[int], list[int]] | None = None  # prefill with a cached prefix: cached, lengths


@torch.library.custom_op("tokenfleet::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    lengths: torch.Tensor | None,
    scale: float,
    group_index: torch.Tensor | None,
    group_shape: list[int],
    triton: bool,
    context_tables: torch.Tensor | None = None,
    context_cached: list[int] | None = None,
    context_lengths: list[int] | None = None,
) -> torch.Tensor:
    """Write this step's K/V into one layer of the pool, attend, return ``[B, T, heads, head_dim]``.

    One opaque op (it mutates the pool), so ``torch.compile`` can compile the model around it."""
    batch, kv_heads, steps, head_dim = key.shape
    write_slots(k_cache, v_cache, key, value, slots)
    gqa = kv_heads != query.shape[1]
    if context_tables is not None:  # prefill after cached prefixes: keys read from the pool
        assert context_cached is not None and context_lengths is not None
        return context_prefill_attention(
            query, k_cache, v_cache, context_tables, context_cached, context_lengths, scale, gqa
        )
    if block_tables is None:  # prefill, packed: the step's own keys, one row per prompt
        assert mask is not None and group_index is not None, "a packed prefill without the kernel"
        return packed_prefill_attention(query, key, value, mask, scale, gqa, group_index, group_shape)
    if triton:
        from tokenfleet.engines.native.attention.triton_paged import paged_decode

        assert lengths is not None
        return paged_decode(query[:, :, 0], k_cache, v_cache, block_tables, lengths, scale)[:, None]
    keys, values = PagedKVStore.gather(k_cache, v_cache, block_tables)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def write_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """The step's keys and values (``[B, kv_heads, T, head_dim]``) to pool slots ``slots`` ``[B x T]``:
    one indexed copy each."""
    batch, kv_heads, steps, head_dim = key.shape
    for cache, new in ((k_cache, key), (v_cache, value)):
        rows = new.transpose(1, 2).reshape(batch * steps, kv_heads, head_dim)
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, rows)


def context_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    cached: list[int],
    lengths: list[int],
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """Attention of packed prompts (``[1, heads, N, head_dim]``) whose K/V are all in the pool
    already (this step's just written, ``cached[b]`` before them): prompt by prompt, its keys
    gathered through its table, its query ``i`` (position ``cached[b] + i``) seeing keys up to its
    own. Returns ``[1, N, heads, head_dim]``. The SDPA route's counterpart of the C++ kernel."""
    _, heads, total, head_dim = query.shape
    out = query.new_empty(total, heads, head_dim)
    start = 0
    for row, (before, length) in enumerate(zip(cached, lengths)):
        if length == 0:
            continue
        keys, values = PagedKVStore.gather(k_cache, v_cache, tables[row : row + 1])
        known = before + length
        q = query[:, :, start : start + length]
        position = torch.arange(before, known, device=query.device)
        mask = torch.arange(known, device=query.device)[None, :] <= position[:, None]  # [length, known]
        o = F.scaled_dot_product_attention(
            q, keys[:, :, :known], values[:, :, :known], attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[start : start + length] = o[0].transpose(0, 1)
        start += length
    return out[None]


# Prompts in one attention call are padded to the longest; a shorter one joins a group while it is
# at least this fraction of the group's longest (attention costs the square of the width).
GROUP_MIN_FRACTION = 0.75


def packed_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    gqa: bool,
    group_index: torch.Tensor,
    group_shape: list[int],
) -> torch.Tensor:
    """Causal attention of prompts laid end to end (``[1, heads, N, head_dim]``), each to its own
    tokens: prompts of similar lengths are padded into one SDPA call under ``mask`` ``[B, 1, L, L]``
    (:class:`PrefillGroups` says which), so a batch of mixed lengths does not pay for the longest
    one's square on every row. Returns ``[1, N, heads, head_dim]``. No host sync: the index
    arithmetic was done once for the step."""
    _, heads, total, head_dim = query.shape
    out = query.new_empty(total, heads, head_dim)
    sizes: list[int] = []
    for g in range(0, len(group_shape), 3):  # each group's rows, then its tokens' two places
        sizes += [group_shape[g], group_shape[g + 1], group_shape[g + 1]]
    parts = group_index.split(sizes)
    for g in range(0, len(group_shape), 3):
        rows, _, width = group_shape[g : g + 3]
        index, src, dst = parts[g : g + 3]
        q, k, v = (unpack(t, src, dst, rows, width) for t in (query, key, value))
        group_mask = mask.index_select(0, index)[:, :, :width, :width]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group_mask, scale=scale, enable_gqa=gqa)
        out[src] = o.transpose(1, 2).reshape(rows * width, heads, head_dim)[dst]
    return out[None]


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped by similar length, longest first (see :data:`GROUP_MIN_FRACTION`)."""
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        if groups and lengths[row] >= GROUP_MIN_FRACTION * lengths[groups[-1][0]]:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def unpack(packed: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Packed tokens ``src`` of ``[1, heads, N, head_dim]`` to places ``dst`` of ``[rows, heads,
    width, head_dim]`` (zeros between)."""
    _, heads, _, head_dim = packed.shape
    padded = packed.new_zeros(rows * width, heads, head_dim)
    padded[dst] = packed[0].transpose(0, 1)[src]
    return padded.view(rows, width, heads, head_dim).transpose(1, 2)


@paged_attention_op.register_fake
def _(query, key, value, k_cache, v_cache, *args, **kwargs):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


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
    layer: int = getattr(module, "layer_idx")  # noqa: B009 (transformers sets it on its attention modules)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = (meta.store.k[layer], meta.store.v[layer])
    if meta.use_kernel:  # the C++ operators: write and attend, no Python
        step = (query, key, value, *cache, meta.write_blocks, meta.write_offsets)
        if meta.is_prefill:
            extra = (meta.block_tables, meta.cached) if meta.cached is not None else ()
            return torch.ops.tokenfleet.paged_prefill(*step, meta.starts, float(scale), *extra), None
        return torch.ops.tokenfleet.paged_decode(*step, meta.block_tables, meta.lengths, float(scale)), None
    groups = meta.groups
    assert meta.slots is not None, "the torch and Triton routes write by slot"
    context = meta.context if meta.is_prefill else None
    out = paged_attention_op(
        query,
        key,
        value,
        *cache,
        meta.slots,
        meta.mask,
        None if meta.is_prefill else meta.block_tables,
        meta.lengths,
        float(scale),
        None if groups is None else groups.index,
        [] if groups is None else groups.shape,
        meta.use_triton,
        meta.block_tables if context is not None else None,
        None if context is None else context[0],
        None if context is None else context[1],
    )
    return out, None


def register() -> str:
    """Make :data:`PAGED_ATTENTION` known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    return PAGED_ATTENTION
