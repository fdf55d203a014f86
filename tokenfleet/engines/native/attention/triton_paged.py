"""Paged decode attention on a GPU: a Triton kernel that reads each sequence's blocks where they lie.

One program per (sequence, query head) walks the sequence's block table, loads one block of
keys and values at a time from the pool (``[blocks, block_size, kv_heads, head_dim]``, the
layout of :class:`~tokenfleet.kvcache.store.PagedKVStore`) and keeps a running softmax (flash
decoding without the split): no gathered copy of the context, no mask, and block tables and
lengths stay on the device, so the step has no host sync and a CUDA graph can replay it. The
gather + SDPA path in :mod:`~tokenfleet.engines.native.attention.paged` is the reference it is tested
against (on the CPU too, in Triton's interpreter: ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

try:  # a GPU build of torch ships Triton; `pip install triton` elsewhere
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:  # Triton's interpreter switch (TRITON_INTERPRET=1) is read here

    @triton.jit
    def paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lengths_ptr,
        out_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_block,
        stride_token,
        stride_head,
        stride_table,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_POW2: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        dim = tl.arange(0, DIM_POW2)
        in_dim = dim < HEAD_DIM
        token = tl.arange(0, BLOCK_SIZE)
        q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dim, mask=in_dim, other=0.0).to(tl.float32)
        length = tl.load(lengths_ptr + seq)
        best = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)  # running max
        total = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)  # running softmax denominator
        acc = tl.zeros([DIM_POW2], tl.float32)
        for i in range(0, tl.cdiv(length, BLOCK_SIZE)):
            block = tl.load(tables_ptr + seq * stride_table + i).to(tl.int64)  # pools pass 2**31 elements
            valid = i * BLOCK_SIZE + token < length
            where = (
                block * stride_block + kv_head * stride_head + token[:, None] * stride_token + dim[None, :]
            )
            tile = valid[:, None] & in_dim[None, :]
            k = tl.load(k_ptr + where, mask=tile, other=0.0).to(tl.float32)
            scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            weights = tl.exp(scores - new_best)
            rescale = tl.exp(best - new_best)
            v = tl.load(v_ptr + where, mask=tile, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            total = total * rescale + tl.sum(weights, axis=0)
            best = new_best
        out = acc / total
        tl.store(
            out_ptr + seq * stride_ob + head * stride_oh + dim, out.to(out_ptr.dtype.element_ty), mask=in_dim
        )


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence (``query`` ``[B, heads, head_dim]``) to its
    ``lengths[b]`` keys in blocks ``block_tables[b]`` of one layer's pool; ``[B, heads, head_dim]``.
    Every row needs ``lengths[b] >= 1`` (the new token's own key is written first)."""
    batch, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and query.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty(batch, heads, head_dim, dtype=query.dtype, device=query.device)
    paged_decode_kernel[(batch, heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        lengths,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        DIM_POW2=1 << (head_dim - 1).bit_length(),
    )
    return out
