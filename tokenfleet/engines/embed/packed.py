"""A BERT-family encoder run on packed tokens: the linears of a whole batch in one matmul over
only its real tokens (no padding), attention per group of similar lengths (padded within the
group, masked). sentence-transformers pads every batch to its longest text; computing only real
tokens is where the time goes to. The same weights and the same operations as Hugging Face's
``BertModel`` in eval mode, in another order: vectors equal within float32 rounding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import torch
import torch.nn.functional as F

BATCH_TOKENS = 8192  # padded tokens per pass: long enough to amortise the call, short for memory
FORWARD_COST_TOKENS = 256  # one more forward pass, in tokens computed (see split_by_length)
ATTENTION_PASS_COST = 16384  # one more attention call, in rows x length^2: a 128-token row's scores
PACKED_ROWS_HINT = 4096  # the rows oneDNN lays weights out for: a packed batch's tokens


@dataclass(frozen=True)
class _Layer:
    qkv: Any  # query, key and value as one linear: one matmul
    attention_out: Any
    attention_norm: Any
    intermediate: Any
    out: Any
    out_norm: Any


def _onednn(linear: torch.nn.Linear) -> Any:
    """oneDNN's float32 GEMM on a weight laid out for it once: 10-20% faster than ``F.linear``'s
    at an encoder batch's rows (docs/PERFORMANCE.md)."""
    from tokenfleet.engines.native.linear.onednn import PackedLinear

    return PackedLinear(linear, rows_hint=PACKED_ROWS_HINT)


class _Eager:
    """A linear off oneDNN (a GPU, bf16) with :class:`PackedLinear`'s fused calls, unfused."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + other


def supports(model: Any) -> bool:
    """Whether ``model`` is a BERT encoder this path computes exactly as Hugging Face does."""
    config = model.config
    return (
        config.model_type == "bert"
        and getattr(config, "position_embedding_type", "absolute") == "absolute"
        and not getattr(config, "is_decoder", False)
        and config.hidden_act == "gelu"
        and type(model).__name__ == "BertModel"
    )


class PackedBert:
    def __init__(self, model: Any):
        self.embeddings = model.embeddings
        self.heads = model.config.num_attention_heads
        self.layers = []
        on_cpu = model.embeddings.word_embeddings.weight.device.type == "cpu"
        fast = _onednn if on_cpu and model.dtype == torch.float32 else _Eager
        for layer in model.encoder.layer:
            attention = layer.attention.self
            parts = (attention.query, attention.key, attention.value)
            qkv = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts))
            qkv.weight.data = torch.cat([p.weight for p in parts]).contiguous()
            qkv.bias.data = torch.cat([p.bias for p in parts])
            self.layers.append(
                _Layer(
                    fast(qkv),
                    fast(layer.attention.output.dense),
                    layer.attention.output.LayerNorm,
                    fast(layer.intermediate.dense),
                    fast(layer.output.dense),
                    layer.output.LayerNorm,
                )
            )

    @torch.inference_mode()
    def __call__(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """The last hidden states of ``ids`` (sorted by ascending length), packed: ``[tokens,
        hidden]``, each input's tokens in turn. Attention runs in groups of similar lengths, each
        padded to its longest: the cuts that compute the fewest scores."""
        lengths = [len(x) for x in ids]
        groups = split_by_length(lengths, power=2, per_pass=ATTENTION_PASS_COST)
        device = self.embeddings.word_embeddings.weight.device
        flat = torch.tensor(list(chain.from_iterable(ids)), device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        emb = self.embeddings
        x = emb.word_embeddings(flat) + emb.position_embeddings(positions)
        x = emb.LayerNorm(x + emb.token_type_embeddings.weight[0])
        plans = [_attention_plan(lengths, start, end, device) for start, end in groups]
        for layer in self.layers:
            qkv = layer.qkv(x)
            context = torch.cat([self._attend(qkv, plan) for plan in plans])
            h = layer.attention_norm(layer.attention_out.plus(context, x))
            x = layer.out_norm(layer.out.plus(layer.intermediate.gelu(h), h))
        return x

    def _attend(self, qkv: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Attention of one group's inputs, their tokens packed in order."""
        hidden = qkv.shape[1] // 3
        rows = qkv[plan.first : plan.last]
        if plan.gather is not None:  # unequal lengths: padded to the longest, keys masked
            rows = rows[plan.gather]
        q, k, v = rows.view(plan.count, plan.longest, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)
        out = out.transpose(1, 2).reshape(plan.count * plan.longest, hidden)
        return out if plan.keep is None else out[plan.keep]


@dataclass(frozen=True)
class _Plan:
    first: int  # the group's tokens in the packed batch: [first, last)
    last: int
    count: int
    longest: int
    gather: torch.Tensor | None  # padded position -> token of the group (padding: any token)
    keep: torch.Tensor | None  # the padded positions that are real tokens, in order
    mask: torch.Tensor | None  # [count, 1, 1, longest]: keys that are real tokens


def _attention_plan(lengths: list[int], start: int, end: int, device: torch.device) -> _Plan:
    offsets = [0, *accumulate(lengths)]
    first, last = offsets[start], offsets[end]
    group = lengths[start:end]
    longest = max(group)
    if min(group) == longest:
        return _Plan(first, last, len(group), longest, None, None, None)
    local = torch.tensor([o - first for o in offsets[start:end]], device=device)
    sizes = torch.tensor(group, device=device)
    column = torch.arange(longest, device=device)
    real = column[None, :] < sizes[:, None]  # [count, longest]
    gather = torch.where(real, local[:, None] + column[None, :], 0).flatten()
    keep = real.flatten().nonzero().squeeze(1)
    return _Plan(first, last, len(group), longest, gather, keep, real[:, None, None, :])


def split_by_length(
    lengths: Sequence[int], power: int = 1, per_pass: float = FORWARD_COST_TOKENS
) -> list[tuple[int, int]]:
    """Where to cut inputs sorted by ascending length into passes: the cuts that compute the least,
    padding included, a pass of ``rows`` inputs padded to ``longest`` costing ``rows *
    longest**power`` (1: linears, 2: attention) plus ``per_pass`` (a pass of few rows runs below
    the machine's rate), at most ``BATCH_TOKENS`` padded tokens per pass (memory). Returns
    ``(start, end)`` ranges, in order."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j inputs
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = lengths[end - 1]
        for start in range(end - 1, -1, -1):
            rows = end - start
            if rows > 1 and rows * longest > BATCH_TOKENS:
                break
            cost = best[start] + rows * longest**power + per_pass
            if cost < best[end]:
                best[end], cut[end] = cost, start
    ranges, end = [], n
    while end > 0:
        ranges.append((cut[end], end))
        end = cut[end]
    return ranges[::-1]


def pool_packed(tokens: torch.Tensor, lengths: list[int], mode: str) -> torch.Tensor:
    """sentence-transformers' pooling over packed ``tokens`` (inputs of ``lengths`` in turn)."""
    device = tokens.device
    sizes = torch.tensor(lengths, device=device)
    starts = torch.tensor([0, *accumulate(lengths)][:-1], device=device)
    if mode == "cls_token":
        return tokens[starts]
    if mode == "lasttoken":
        return tokens[starts + sizes - 1]
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)
    shape = (len(lengths), tokens.shape[1])
    if mode == "max_tokens":
        index = owner[:, None].expand_as(tokens)
        lowest = torch.full(shape, -torch.inf, dtype=tokens.dtype, device=device)
        return lowest.scatter_reduce(0, index, tokens, "amax")
    summed = torch.zeros(shape, dtype=tokens.dtype, device=device).index_add_(0, owner, tokens)
    counts = sizes.to(tokens.dtype)[:, None]
    return summed / (counts.sqrt() if mode == "mean_sqrt_len_tokens" else counts)
