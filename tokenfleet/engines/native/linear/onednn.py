"""Linears on oneDNN: a weight reordered once at load into oneDNN's blocked layout (no second
copy), computed by its float32 GEMM. For float32 models always (faster than ``F.linear``'s MKL GEMM
at decode shapes); for bf16 ones where this CPU's float32 GEMM outruns its bf16 one (see
``cpu_linear``)."""

from __future__ import annotations

import torch
from torch import nn

DECODE_ROWS_HINT = 32  # the batch oneDNN lays the weight out for; any row count still works


class PackedLinear(nn.Module):
    """An ``nn.Linear`` computed by oneDNN on a float32 weight in its blocked layout; inputs of
    another dtype are widened and the output is rounded back to that dtype."""

    DTYPES = (torch.float32, torch.bfloat16)  # the weights it takes

    def __init__(self, linear: nn.Linear, rows_hint: int = DECODE_ROWS_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        weight = linear.weight.detach().float()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        if self.dtype == torch.float32:
            self.bias = linear.bias
        else:  # a bf16 GEMM adds its bias in float32 before rounding too
            bias = None if linear.bias is None else linear.bias.detach().float()
            self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        out = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed_weight, self.bias, "none", [], "")
        return out.to(self.dtype)

    # Epilogues oneDNN computes in the GEMM's own pass over its output (float32 weights): the same
    # values as the separate operation after it (tests/engine/test_embed.py), one pass fewer

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``F.gelu(self(x))``, exact (erf) GELU."""
        if self.dtype != torch.float32:
            return nn.functional.gelu(self(x))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "gelu", [], "none")

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) + other`` (a residual)."""
        if self.dtype != torch.float32:
            return self(x) + other
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed_weight, self.bias, "add")
