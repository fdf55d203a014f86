"""Batched sampling on the logits' device: counter-based randomness (batch-independent), the
distribution it samples matches temperature, top-k and top-p, extreme values keep the most likely
token, and a row that cannot be sampled fails alone."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokenfleet.engines.native.sampling.draw import choose_tokens, sample, uniform  # noqa: E402


class Row:
    def __init__(self, temperature=1.0, top_p=1.0, top_k=0, seed=None, generated=()):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.request = type("R", (), {"seed": seed})()
        self.generated = list(generated)
        self.sampling_seed = None
        self.sampling_error = None


def run(logits, rows, steps):
    """Each row's tokens over ``steps`` steps of the same logits (its counter advancing)."""
    for _ in range(steps):
        for row, token in zip(rows, choose_tokens(logits, rows)):
            row.generated.append(token)
    return [row.generated for row in rows]


def test_a_seeded_row_samples_the_same_whatever_its_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    alone = run(logits[2:3], [Row(0.8, 0.9, 40, seed=11)], 20)[0]
    mates = [Row(1.0, seed=1), Row(0.0), Row(0.8, 0.9, 40, seed=11), Row(1.3, 0.5, seed=None), Row(0.0)]
    assert run(logits, mates, 20)[2] == alone
    reordered = [mates[0].__class__(0.8, 0.9, 40, seed=11), Row(0.7, seed=5)]
    assert run(torch.stack([logits[2], logits[0]]), reordered, 20)[0] == alone
    assert len(set(alone)) > 3  # it does sample


def test_a_resumed_row_draws_the_numbers_it_drew_before():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    first = run(logits, [Row(seed=9)], 12)[0]
    resumed = Row(seed=9, generated=first[:5])  # as after a preemption: 5 tokens kept
    assert run(logits, [resumed], 7)[0] == first


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    rows = [Row(0.0), Row(1.0, seed=1), Row(0.0), Row(1.0, top_k=1, seed=2)]
    chosen = choose_tokens(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert chosen[0] == argmax[0] and chosen[2] == argmax[2] and chosen[3] == argmax[3]


def frequencies(logits, temperature=1.0, top_k=0, top_p=1.0, draws=20000):
    row = logits[None].expand(draws, -1)
    us = torch.tensor([uniform(77, i) for i in range(draws)], dtype=torch.float64)
    ones = torch.ones(draws, dtype=torch.float64)
    tokens, finite = sample(row, ones * temperature, ones * top_k, ones * top_p, us)
    assert bool(finite.all())
    return torch.bincount(tokens, minlength=logits.numel()).double() / draws


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (2.0, 4, 0.8)]
)
def test_the_sampled_distribution_is_the_truncated_softmax(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, 0.2])
    scaled = logits.double() / temperature
    if top_k:  # top-p then applies to the distribution top-k leaves (as in HF and vLLM)
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    probs = torch.softmax(scaled, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for token in order.tolist():
        if probs[token] == 0 or mass >= top_p:
            break
        keep[token], mass = True, mass + float(probs[token])
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()
    seen = frequencies(logits, temperature, top_k, top_p)
    assert torch.allclose(seen, expected, atol=0.012), (seen, expected)
    assert bool((seen[~keep] == 0).all())  # nothing outside the kept set, ever


def test_extreme_values_keep_the_most_likely_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    rows = [Row(1e-300, seed=1), Row(1.0, top_p=1e-300, seed=2), Row(1e-40, top_p=1e-300, top_k=3, seed=3)]
    assert choose_tokens(logits, rows) == logits.argmax(-1).tolist()


def test_the_counter_stream_is_uniform():
    us = torch.tensor([uniform(seed, i) for seed in (0, 1, 2**62) for i in range(4000)])
    assert float(us.min()) >= 0.0 and float(us.max()) < 1.0
    assert torch.histc(us, bins=10, min=0, max=1).div(len(us)).sub(0.1).abs().max() < 0.02
    assert uniform(5, 0) != uniform(5, 1) != uniform(6, 1)


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    rows = [Row(0.0, seed=1), Row(1.0, seed=1), Row(1.0, seed=1)]
    chosen = choose_tokens(logits, rows)
    assert chosen[0] == int(logits[0].argmax()) and chosen[1] is None and isinstance(chosen[2], int)
    assert "NaN" in rows[1].sampling_error
