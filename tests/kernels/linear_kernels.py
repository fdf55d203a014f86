"""What the tests of tokenfleet's linear kernels (test_cpu_linear.py, test_f32_linear.py) share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import make_runner

AGREEMENT_PROMPTS = [[5, 9, 13, 40, 2, 77], [100, 3], list(range(30, 60))]


def needs_kernel(available: Callable[[], bool], reason: str) -> Callable[[Any], Any]:
    """Marks a test that needs the kernels (built once a machine) as integration; it fails under CI
    where they did not build, and is skipped where they did but ``available()`` says this CPU lacks
    what the kernel needs (checked when the test runs: see conftest's ``pytest_runtest_setup``)."""

    def mark(test: Any) -> Any:
        return pytest.mark.integration(pytest.mark.cpu_kernel(available, reason)(test))

    return mark


def greedy_steps(runner: Any, prompts: list[list[int]], decode_steps: int) -> tuple[list, list[torch.Tensor]]:
    """Prefill ``prompts`` on ``engine`` (a ModelRunner) and decode ``decode_steps`` greedy steps:
    (the tokens each step chose, the logits of the prefill and of each decode step)."""
    from tokenfleet.kvcache.allocator import BlockAllocator

    alloc = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching=False)  # all computed here
    ids = list(range(len(prompts)))
    tables = [alloc.allocate(seq, p).table for seq, p in zip(ids, prompts)]
    step = runner.prefill(tables, prompts).logits
    tokens, logits = [], [step]
    for _ in range(decode_steps):
        chosen = step.argmax(-1).tolist()
        tokens.append(chosen)
        for seq, token in zip(ids, chosen):
            alloc.append_slot(seq, token)
        step = runner.decode([alloc.block_table(s) for s in ids], [alloc.num_tokens(s) for s in ids], chosen)
        logits.append(step)
    return tokens, logits


def bf16_engine_logits(
    model_dir: str, bf16_linear: str, decode_steps: int
) -> tuple[set[str], list[torch.Tensor]]:
    """A bf16 ModelRunner on the ``bf16_linear`` route: the kinds of module it holds, and its logits
    over :data:`AGREEMENT_PROMPTS` (prefill, then ``decode_steps`` greedy steps)."""

    runner = make_runner(model_dir, device="cpu", dtype="bfloat16", bf16_linear=bf16_linear)
    kinds = {type(m).__name__ for m in runner.model.modules()}
    return kinds, greedy_steps(runner, AGREEMENT_PROMPTS, decode_steps)[1]
