"""bf16 linears on tokenfleet's kernel (``csrc/linear_bf16_cpu.cpp``): VDPBF16PS with AVX512-BF16,
float32 FMAs on widened weights with AVX-512 or AVX2; whether it is built here, and how fast it
runs against the library's GEMMs (what ``--bf16-linear auto`` decides on, in ``cpu_linear``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenfleet.engines.native.kernels.loader import load_kernels
from tokenfleet.engines.native.linear.onednn import DECODE_ROWS_HINT, PackedLinear
from tokenfleet.engines.native.linear.race import race_routes


class KernelLinear(nn.Module):
    """A bf16 ``nn.Linear`` computed by ``tokenfleet::linear_bf16`` on its weight packed into
    64-column panels (the original weight is not kept)."""

    DTYPES = (torch.bfloat16,)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.tokenfleet.pack_linear_bf16(linear.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        # the kernel adds the bias to its float32 sums: converted once here, not on every call
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tokenfleet.linear_bf16(x, self.packed_weight, self.out_features, self.bias)


def bf16_kernel_available() -> bool:
    """Whether ``tokenfleet::linear_bf16`` is built for this CPU (it needs AVX-512 F, BW and VL, or
    AVX2 and FMA)."""
    if load_kernels() is None:
        return False
    try:
        packed = torch.ops.tokenfleet.pack_linear_bf16(torch.ones(2, 2, dtype=torch.bfloat16))
        torch.ops.tokenfleet.linear_bf16(torch.ones(1, 2, dtype=torch.bfloat16), packed, 2, None)
    except RuntimeError:  # built without AVX-512 or AVX2
        return False
    return True


def native_bf16_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The library's bf16 linear on ``weight``: oneDNN's on a prepacked weight, or ``F.linear``
    where oneDNN has no bf16 linear for this CPU (AVX2 only: emulated)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_ROWS_HINT)
    except RuntimeError:
        return lambda x: torch.nn.functional.linear(x, weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def bf16_linear_speeds(
    size: int = 1024, weights: int = 12, rounds: int = 5
) -> dict[str, tuple[float, float]]:
    """Seconds (best of ``rounds``) of a ``size`` x ``size`` bf16 linear on each route: ``kernel``,
    ``native`` (oneDNN bf16, prepacked) and ``float32`` (oneDNN float32, prepacked); at 32 rows
    through ``weights`` weights in turn (24 MB: from memory, as a decode step reads them), and at
    512 rows through one. The routes take turns within each round, so a shared host's drift hits
    them all. ~0.3 s; ~1 s where the library emulates bf16 matmuls."""
    load_kernels()  # registers tokenfleet::linear_bf16
    routes: dict[str, list] = {"kernel": [], "native": [], "float32": []}
    for _ in range(weights):
        linear = nn.Linear(size, size, bias=False, dtype=torch.bfloat16)
        routes["kernel"].append(KernelLinear(linear))
        routes["native"].append(native_bf16_linear(linear.weight.detach()))
        routes["float32"].append(PackedLinear(linear))
    decode_x = torch.randn(DECODE_ROWS_HINT, size).to(torch.bfloat16)
    prefill_x = torch.randn(512, size).to(torch.bfloat16)

    return race_routes(routes, decode_x, prefill_x, rounds)
