"""Next-token choice: greedy rows in one argmax, sampled rows with their own seeded generator."""

from __future__ import annotations

import torch


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one request: seeded when the request gives a seed, random otherwise."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_row(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen: torch.Generator
) -> int:
    """Sample one token from ``logits`` ``[vocab]`` with temperature, top-k and top-p (nucleus).

    In float64 with the largest logit subtracted first: a temperature the validator accepts
    (down to 1e-300) must neither overflow nor leave an all-zero distribution; the most likely
    token is always kept, whatever ``top_p`` (a top_p below float32's range rounded to 0 once and
    dropped every token). Raises ``ValueError`` for a row that still cannot be sampled."""
    scaled = (logits.double() - logits.max().double()) / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("the logits hold NaN or infinity")
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return int(order[torch.multinomial(sorted_probs, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def choose_tokens(logits: torch.Tensor, params: list) -> list[int | None]:
    """One token per row of ``logits`` ``[B, vocab]``; ``params[i]`` has ``temperature``,
    ``top_p``, ``top_k``, ``request.seed`` and ``generator`` (a
    :class:`~tokenfleet.core.sequence.SeqState`), which is made here on a sampled row's first use.
    A row that cannot be sampled gets ``None`` and its error in ``sampling_error``: it fails
    alone, its batch-mates go on."""
    chosen: list[int | None] = logits.argmax(dim=-1).tolist()  # the one host sync of a greedy step
    for row, p in enumerate(params):
        if p.temperature > 0.0:
            if p.generator is None:
                p.generator = make_generator(p.request.seed, logits.device)
            try:
                chosen[row] = sample_row(logits[row], p.temperature, p.top_p, p.top_k, p.generator)
            except (ValueError, RuntimeError) as e:
                chosen[row] = None
                p.sampling_error = f"cannot sample from this row's distribution: {e}"
    return chosen
