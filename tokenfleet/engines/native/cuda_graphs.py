"""Decode steps as CUDA graphs: captured once per padded batch size at start-up, replayed per step.

A decode step of a small model is hundreds of kernel launches from Python, and on a fast GPU the
launches, not the kernels, set its time. A graph replays them all in one call. What a graph
needs: fixed addresses and shapes. So each captured size has one flat device buffer for the
step's integer inputs (the runner's one host-to-device copy lands in it), block tables padded to
the widest a sequence can have, and attention by the Triton kernel (its work depends on the
lengths on the device, not on shapes). Batches larger than the largest size, or contexts wider
than the tables, run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenfleet.engines.native.attention.paged import StepMetadata
from tokenfleet.engines.native.attention.step_inputs import Uploader, decode_step
from tokenfleet.kvcache.store import PagedKVStore

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, StepMetadata], torch.Tensor]  # ids, positions -> logits


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the flat buffer the step's integer inputs are copied into
    logits: torch.Tensor  # [rows, vocab], written by each replay


class DecodeGraphs:
    """CUDA graphs of decode at ``sizes`` rows, tables ``max_blocks`` wide."""

    def __init__(
        self,
        store: PagedKVStore,
        upload: Uploader,
        sizes: Sequence[int],
        max_blocks: int,
        scratch_block: int,
        pad_token_id: int,
    ):
        self.store, self.upload = store, upload
        self.sizes, self.max_blocks = list(sizes), max_blocks
        self.scratch_block, self.pad_token_id = scratch_block, pad_token_id
        self.captured: dict[int, Captured] = {}
        self.replays = 0  # steps served by a graph: for tests and profiles

    def _send(
        self, rows: int, tables: torch.Tensor, stored: torch.Tensor, tokens: torch.Tensor, into: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
        """A step padded to ``rows`` rows and full-width tables (padding rows: one token in the
        scratch block), copied into ``into``; its inputs as views of ``into``."""
        batch, width = tables.shape
        full = torch.full((rows, self.max_blocks), self.scratch_block, dtype=torch.long)
        full[:batch, :width] = tables
        lengths = torch.ones(rows, dtype=torch.long)
        lengths[:batch] = stored
        ids = torch.full((rows,), self.pad_token_id, dtype=torch.long)
        ids[:batch] = tokens
        return decode_step(self.store, self.upload, full, lengths, ids, False, use_triton=True, into=into)

    def capture(self, forward: Forward) -> None:
        """Record one graph per size (after two eager warm-up runs on a side stream, as CUDA
        graphs require); a model whose forward cannot be captured leaves decode eager, logged."""
        pool = None
        for rows in self.sizes:
            inputs = torch.empty(rows * (4 + self.max_blocks), dtype=torch.long, device=self.upload.device)
            empty = torch.empty(0, 1, dtype=torch.long)
            step = self._send(rows, empty, empty[:, 0], empty[:, 0], inputs)
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        forward(*step)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = forward(*step)
            except RuntimeError as e:
                log.warning("CUDA graphs off (decode stays eager): capture at %d rows failed: %s", rows, e)
                self.captured.clear()
                return
            pool = graph.pool()
            self.captured[rows] = Captured(graph, inputs, logits)
        log.info("decode captured as CUDA graphs at batch sizes %s", ", ".join(map(str, self.sizes)))

    def run(
        self, block_tables: torch.Tensor, stored: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` of this step from a graph, or ``None`` when none fits it."""
        batch, width = block_tables.shape
        rows = next((r for r in self.sizes if r >= batch and r in self.captured), None)
        if rows is None or width > self.max_blocks:
            return None
        captured = self.captured[rows]
        self._send(rows, block_tables, stored, tokens, captured.inputs)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[:batch]
