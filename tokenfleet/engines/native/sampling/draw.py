"""Next-token choice for a whole batch on the logits' device: greedy rows by argmax, sampled rows
by temperature, top-k and top-p, then one device-to-host copy of the chosen ids.

Randomness is counter-based: the ``i``-th token of a request draws the uniform number
:func:`uniform` ``(seed, i)``, computed on the host and sent with the step's parameters. So a
seeded request's output depends only on its seed and its logits: not on its batch-mates, the
batch's order, the device, or a preemption (a resumed request draws the same numbers again).
A request without a seed gets a random one on first use.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import torch

MASK64 = (1 << 64) - 1
REDRAW = 0x5DEECE66D  # mixed into the seed of a second draw
NAN_ERROR = "cannot sample from this row's distribution: the logits hold NaN or infinity"


def uniform(seed: int, counter: int) -> float:
    """A number in [0, 1) fixed by ``(seed, counter)``: splitmix64's finaliser over both (53 bits)."""
    x = (seed * 0x9E3779B97F4A7C15 + (counter + 1) * 0xD1B54A32D192ED03) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((x ^ (x >> 31)) >> 11) * 2.0**-53


def row_seed(row: Any) -> int:
    """The request's seed, or one drawn once for it (kept in ``row.sampling_seed``)."""
    if row.sampling_seed is None:
        seed = row.request.seed
        row.sampling_seed = secrets.randbits(63) if seed is None else int(seed) & MASK64
    return int(row.sampling_seed)


def choose_tokens(logits: torch.Tensor, params: Sequence[Any], redraw: bool = False) -> list[int | None]:
    """One token per row of ``logits`` ``[B, vocab]``; ``params[i]`` has ``temperature``,
    ``top_p``, ``top_k``, ``generated``, ``request.seed`` and ``sampling_seed`` (a
    :class:`~tokenfleet.core.sequence.SeqState`). A row that cannot be sampled gets ``None`` and
    its error in ``sampling_error``: it fails alone, its batch-mates go on. ``redraw``: a second
    draw for the same token (after its grammar refused the first), from an independent number."""
    sampled = [row for row, p in enumerate(params) if p.temperature > 0.0]
    salt = REDRAW if redraw else 0
    if not sampled:
        return logits.argmax(dim=-1).tolist()  # the one device-to-host copy of a greedy step
    host = torch.tensor(
        [
            [params[r].temperature for r in sampled],
            [float(params[r].top_k) for r in sampled],
            [params[r].top_p for r in sampled],
            [uniform(row_seed(params[r]) ^ salt, len(params[r].generated)) for r in sampled],
            sampled,
        ],
        dtype=torch.float64,
    )
    if logits.device.type != "cpu":  # one pinned, non-blocking copy (torch caches pinned blocks)
        host = host.pin_memory()
    knobs = host.to(logits.device, non_blocking=True)
    temperature, top_k, top_p, uniforms, rows = knobs.unbind(0)
    rows = rows.long()
    tokens = logits.argmax(dim=-1)
    truncate = any(params[r].top_k > 0 or params[r].top_p < 1.0 for r in sampled)
    picked, finite = sample(logits.index_select(0, rows), temperature, top_k, top_p, uniforms, truncate)
    tokens[rows] = torch.where(finite, picked, -1)
    chosen: list[int | None] = []
    for row, token in enumerate(tokens.tolist()):  # the step's one device-to-host copy
        if token < 0:
            params[row].sampling_error = NAN_ERROR
        chosen.append(token if token >= 0 else None)
    return chosen


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    truncate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[R, vocab]`` by inverse CDF at ``uniforms``; the
    other arguments are per row (``top_k`` 0: off; ``top_p`` 1: off; ``truncate`` False: both off
    for every row, which spares the sort). Returns the tokens and which rows were finite (the
    others' tokens are meaningless). No host sync.

    In float64 with each row's largest logit subtracted first: a temperature the validator
    accepts (down to 1e-300) must neither overflow nor leave an all-zero distribution; the most
    likely token is always kept, whatever ``top_p``; tokens tied with the k-th stay in."""
    vocab = logits.shape[-1]
    scaled = (logits.double() - logits.max(dim=-1, keepdim=True).values.double()) / temperature[:, None]
    order = None
    if truncate:
        scaled, order = scaled.sort(dim=-1, descending=True)
        k = top_k.long().clamp(0, vocab)
        kth = scaled.gather(-1, (k.clamp(min=1) - 1)[:, None])
        scaled = scaled.masked_fill((k > 0)[:, None] & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    finite = torch.isfinite(probs).all(dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    if truncate:  # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(-1)
    # the first place whose CDF exceeds u x mass: never a zero-probability token
    at = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    return (at if order is None else order.gather(-1, at))[:, 0], finite
