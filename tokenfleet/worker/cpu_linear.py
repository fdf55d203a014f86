"""Linears on the CPU through oneDNN, on float32 weights reordered once at load.

``F.linear`` in float32 runs MKL's GEMM, and so does a compiled graph (inductor's freezing packs
float32 weights for MKL at a static batch). At decode shapes oneDNN on a prepacked weight was the
faster of the two: on an AVX2 EPYC, 116-142 GFLOP/s against MKL's 66-118 at 32 rows, and a
batch-32 decode step of a 113M model took 116 ms against 163. vLLM-CPU's linears take the same
route. The reordered weight replaces the original (no second copy), so only linears whose weight
nothing else shares are swapped. ``TOKENFLEET_ONEDNN_LINEAR=0`` keeps ``F.linear``.

bf16 linears take the float32 GEMM too where this CPU runs it faster than its bf16 one (on an
AVX512-BF16 Xeon without AMX, oneDNN's bf16 GEMM ran at ~0.6x of float32's). The arithmetic is
that of a bf16 GEMM: bf16 inputs widen to float32 exactly, the product of two bf16 numbers is
exact in float32, the sums are float32 (as a bf16 GEMM accumulates) and the output is rounded
to bf16. The cost is memory: the weight is held in float32, twice its bf16 size.
``TOKENFLEET_BF16_LINEAR`` = ``auto`` (measure, the default), ``float32`` or ``native``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import torch
from torch import nn

from tokenfleet.worker.device import BF16_SLOWER_HINT, bf16_matmul_speed

DECODE_ROWS_HINT = 32  # the batch oneDNN lays the weight out for; any row count still works
BF16_ROUTES = ("auto", "float32", "native")

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` computed by oneDNN on a float32 weight in its blocked layout; inputs of
    another dtype are widened and the output is rounded back to that dtype."""

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


def bf16_linear_route() -> str:
    route = os.environ.get("TOKENFLEET_BF16_LINEAR", "auto")
    if route not in BF16_ROUTES:
        raise ValueError(f"TOKENFLEET_BF16_LINEAR={route!r}; use one of {', '.join(BF16_ROUTES)}")
    return route


def available_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None


def onednn_linears_wanted(device: torch.device, dtype: torch.dtype, model: nn.Module | None = None) -> bool:
    """float32 always (on the CPU, with oneDNN); bf16 when float32 GEMMs are the faster here and
    (under ``auto``) the float32 copies of ``model``'s linear weights fit in half the free memory."""
    if not (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and os.environ.get("TOKENFLEET_ONEDNN_LINEAR", "1") != "0"
    ):
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    route = bf16_linear_route()
    if route != "auto":
        return route == "float32"
    speed = bf16_matmul_speed()
    if speed >= BF16_SLOWER_HINT:
        return False
    # a float32 weight takes 2 bytes an element more than its bf16 original
    extra = 0 if model is None else sum(child.weight.numel() * 2 for _, _, child in swappable_linears(model))
    free = available_memory_bytes()
    if free is not None and extra > free / 2:
        log.info(
            "bf16 matmuls run at %.2fx float32's on this CPU, but float32 weights would take %.1f GiB "
            "more of %.1f GiB free: linears stay on bf16 GEMMs (TOKENFLEET_BF16_LINEAR=float32 forces it)",
            speed,
            extra / 2**30,
            free / 2**30,
        )
        return False
    log.info(
        "bf16 matmuls run at %.2fx float32's on this CPU: linears compute on float32 GEMMs "
        "(the same products and float32 sums, outputs rounded to bf16; weights held in float32, "
        "%.1f GiB more). TOKENFLEET_BF16_LINEAR=native keeps bf16 GEMMs",
        speed,
        extra / 2**30,
    )
    return True


def swappable_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every float32 or bf16 ``nn.Linear`` of ``model`` whose
    weight no other module uses (a tied output embedding stays as it is)."""
    users = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.dtype in (torch.float32, torch.bfloat16)
        and users[id(child.weight)] == 1
    ]


def pack_linears(model: nn.Module) -> int:
    """Swap each of :func:`swappable_linears` for a :class:`PackedLinear`; returns how many."""
    swaps = swappable_linears(model)
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
