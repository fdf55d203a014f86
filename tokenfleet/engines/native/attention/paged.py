"""The paged attention function that Hugging Face models call instead of their own.

Registered with transformers' ``AttentionInterface`` under :data:`PAGED_ATTENTION`; a model
loaded with ``attn_implementation=PAGED_ATTENTION`` calls :func:`paged_attention` in every layer
with the already-rotated query/key/value. The engine passes a :class:`StepMetadata` as the
``tokenfleet_step`` keyword of the model's forward; transformers hands it through untouched.
Without it (e.g. ``model.generate``) the function falls back to plain SDPA.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch

from tokenfleet.engines.native.attention.torch_route import paged_attention_op
from tokenfleet.kvcache.store import PagedKVStore

PAGED_ATTENTION = "tokenfleet_paged"
# Some architectures' decoder layers do not hand their forward's keyword arguments on to attention
# (StableLM), so the step's metadata also rides here while the runner's forward runs.
CURRENT_STEP: ContextVar[StepMetadata | None] = ContextVar("tokenfleet_step", default=None)
# While set (the load-time probe), every layer's call records the variants its architecture asks
# for: layer index -> (sliding window, softcap), 0 for none.
SEEN_VARIANTS: ContextVar[dict[int, tuple[int, float]] | None] = ContextVar("variants", default=None)


@dataclass
class PrefillGroups:
    """Prompts of similar lengths padded into one SDPA call each (see ``torch_route.length_groups``).
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


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tokenfleet_step: StepMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    window, cap = int(sliding_window or 0), float(softcap or 0.0)
    meta = tokenfleet_step
    # a compiled graph breaks at a context variable, and its resumed frames, guarded loosely
    # (compiled.keep_guards), would serve every layer as the first: compiled steps pass the keyword
    if not torch.compiler.is_compiling():
        seen = SEEN_VARIANTS.get()
        if seen is not None:
            seen[getattr(module, "layer_idx")] = (window, cap)  # noqa: B009
        meta = meta or CURRENT_STEP.get()
    if meta is None:  # not one of our steps (e.g. ``model.generate``): transformers' SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer: int = getattr(module, "layer_idx")  # noqa: B009 (transformers sets it on its attention modules)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = (meta.store.k[layer], meta.store.v[layer])
    if meta.use_kernel:  # the C++ operators: write and attend, no Python
        if window or cap:  # the runner keeps such models off the kernels; never compute them wrong
            raise NotImplementedError("the CPU attention kernels take no sliding window or softcap")
        step = (query, key, value, *cache, meta.write_blocks, meta.write_offsets)
        if meta.is_prefill:
            extra = (meta.block_tables, meta.cached) if meta.cached is not None else ()
            return torch.ops.tokenfleet.paged_prefill(*step, meta.starts, float(scale), *extra), None
        return torch.ops.tokenfleet.paged_decode(*step, meta.block_tables, meta.lengths, float(scale)), None
    if meta.use_triton and not meta.is_prefill and (window or cap):
        raise NotImplementedError("the Triton decode kernel takes no sliding window or softcap")
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
        window,
        cap,
    )
    return out, None


def register() -> str:
    """Make :data:`PAGED_ATTENTION` known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    return PAGED_ATTENTION
