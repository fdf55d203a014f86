"""float32 linears on the CPU through oneDNN, on weights reordered once at load.

``F.linear`` in float32 runs MKL's GEMM, and so does a compiled graph (inductor's freezing packs
float32 weights for MKL at a static batch). At decode shapes oneDNN on a prepacked weight was the
faster of the two: on an AVX2 EPYC, 116-142 GFLOP/s against MKL's 66-118 at 32 rows, and a
batch-32 decode step of a 113M model took 116 ms against 163. vLLM-CPU's linears take the same
route. The reordered weight replaces the original (no second copy), so only linears whose weight
nothing else shares are swapped. ``TOKENFLEET_ONEDNN_LINEAR=0`` keeps ``F.linear``.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch import nn

DECODE_ROWS_HINT = 32  # the batch oneDNN lays the weight out for; any row count still works


class PackedLinear(nn.Module):
    """A float32 ``nn.Linear`` whose weight is held in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, rows_hint: int = DECODE_ROWS_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def onednn_linears_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and os.environ.get("TOKENFLEET_ONEDNN_LINEAR", "1") != "0"
    )


def pack_linears(model: nn.Module) -> int:
    """Swap every float32 ``nn.Linear`` of ``model`` whose weight no other module uses (a tied
    output embedding stays as it is) for a :class:`PackedLinear`; returns how many."""
    users = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32 and users[id(child.weight)] == 1
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
