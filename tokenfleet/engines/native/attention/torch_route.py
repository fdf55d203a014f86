"""Attention in torch, for the steps the C++ kernels do not take (no compiler, a GPU, an
architecture's sliding window or softcap): the step's K/V written by slot, then SDPA over packed
prompts grouped by length, over a prompt's cached blocks, or over each sequence's gathered blocks;
eager arithmetic where scores are soft-capped."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfleet.kvcache.store import PagedKVStore


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
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write this step's K/V into one layer of the pool, attend, return ``[B, T, heads, head_dim]``.
    ``window`` > 0: a query sees only the ``window`` newest keys up to its own (a sliding window);
    ``softcap`` > 0: scores pass through ``softcap * tanh(score / softcap)`` (Gemma 2).

    One opaque op (it mutates the pool), so ``torch.compile`` can compile the model around it."""
    batch, kv_heads, steps, head_dim = key.shape
    write_slots(k_cache, v_cache, key, value, slots)
    how = Scores(scale, kv_heads != query.shape[1], window, softcap)
    if context_tables is not None:  # prefill after cached prefixes: keys read from the pool
        assert context_cached is not None and context_lengths is not None
        return context_prefill_attention(
            query, k_cache, v_cache, context_tables, context_cached, context_lengths, how
        )
    if block_tables is None:  # prefill, packed: the step's own keys, one row per prompt
        assert mask is not None and group_index is not None, "a packed prefill without the kernel"
        return packed_prefill_attention(query, key, value, mask, how, group_index, group_shape)
    if triton:
        from tokenfleet.engines.native.attention.triton_paged import paged_decode

        assert lengths is not None
        return paged_decode(query[:, :, 0], k_cache, v_cache, block_tables, lengths, scale)[:, None]
    keys, values = PagedKVStore.gather(k_cache, v_cache, block_tables)
    if window:
        assert mask is not None and lengths is not None
        key_pos = torch.arange(keys.shape[2], device=keys.device)
        mask = mask & (key_pos[None, :] >= (lengths - window)[:, None])[:, None, None, :]
    return how.attend(query, keys, values, mask).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class Scores:
    """How a layer's attention scores are made: scale, grouped KV heads, and the variants its
    architecture declares (a sliding ``window``, a ``softcap``; 0: none)."""

    scale: float
    gqa: bool
    window: int = 0
    softcap: float = 0.0

    def band(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Causality and the window: which keys each query position sees ``[Q, K]``."""
        seen = key_pos[None, :] <= query_pos[:, None]
        if self.window:
            seen &= key_pos[None, :] > query_pos[:, None] - self.window
        return seen

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``softmax(scores) @ v`` under boolean ``mask``: SDPA, or where scores are soft-capped
        the eager arithmetic transformers' own eager attention does (float32 softmax)."""
        if not self.softcap:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa
            )
        if self.gqa:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, v)


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
    how: Scores,
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
        mask = how.band(position, torch.arange(known, device=query.device))  # [length, known]
        o = how.attend(q, keys[:, :, :known], values[:, :, :known], mask)
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
    how: Scores,
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
        if how.window:
            position = torch.arange(width, device=mask.device)
            group_mask = group_mask & how.band(position, position)
        o = how.attend(q, k, v, group_mask)
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
