"""float32 linears on tokenfleet's kernel (``csrc/linear_f32_cpu.cpp``), and the start-up choice
between it and the library's GEMMs, named as ``--f32-linear`` names the routes:

- ``kernel``: :class:`F32KernelLinear`, on a weight packed once at load into column panels
  (48 wide with AVX-512, 16 with AVX2).
- ``onednn``: oneDNN on a prepacked weight (``onednn_linear.PackedLinear``).
- ``native``: the model's own ``F.linear``.

``auto`` times the kernel against the route it would otherwise take and keeps it where it is at
least as fast at decode rows and not much slower at prefill rows (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from tokenfleet.engines.native.kernels.loader import load_kernels
from tokenfleet.engines.native.linear.onednn import PackedLinear
from tokenfleet.engines.native.linear.race import race_routes

log = logging.getLogger(__name__)

DECODE_ROWS = 32
PREFILL_ROWS = 512
KERNEL_MIN_DECODE_GAIN = 1.0  # auto takes the kernel when at least as fast at decode rows ...
KERNEL_MAX_PREFILL_LOSS = 0.95  # ... and at least this fast at prefill rows


class F32KernelLinear(nn.Module):
    """A float32 ``nn.Linear`` computed by ``tokenfleet::linear_f32`` on its weight packed into
    column panels (the original weight is not kept, except where another module shares it)."""

    DTYPES = (torch.float32,)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.tokenfleet.pack_linear_f32(linear.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tokenfleet.linear_f32(x, self.packed_weight, self.out_features, self.bias)


def f32_kernel_available() -> bool:
    """Whether ``tokenfleet::linear_f32`` is built for this CPU (it needs AVX-512, or AVX2 and FMA)."""
    if load_kernels() is None:
        return False
    try:
        packed = torch.ops.tokenfleet.pack_linear_f32(torch.ones(2, 2))
        torch.ops.tokenfleet.linear_f32(torch.ones(1, 2), packed, 2, None)
    except RuntimeError:  # built without AVX-512 or AVX2
        return False
    return True


def f32_linear_speeds(
    rival: Callable[[nn.Linear], Callable[[torch.Tensor], torch.Tensor]],
    size: int = 1024,
    weights: int = 12,
    rounds: int = 5,
) -> dict[str, tuple[float, float]]:
    """Seconds (best of ``rounds``) of a ``size`` x ``size`` float32 linear on the kernel and on
    ``rival`` (what builds the other route's linear): at 32 rows through ``weights`` weights in
    turn (48 MB: from memory, as a decode step reads them) and at 512 rows through one, the two
    taking turns within each round. ~0.2 s."""
    linears = [nn.Linear(size, size, bias=False) for _ in range(weights)]
    routes: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "kernel": [F32KernelLinear(m) for m in linears],
        "rival": [rival(m) for m in linears],
    }
    decode_x, prefill_x = torch.randn(DECODE_ROWS, size), torch.randn(PREFILL_ROWS, size)

    return race_routes(routes, decode_x, prefill_x, rounds)


def f32_kernel_wanted(device: torch.device, dtype: torch.dtype, route: str, onednn: bool) -> bool:
    """Whether a float32 model's linears take :class:`F32KernelLinear`: ``route`` ``kernel`` asks
    for it (where it is built), ``auto`` times it against oneDNN (or ``F.linear`` where oneDNN is
    off or missing) and logs the ratios."""
    if device.type != "cpu" or dtype != torch.float32 or route not in ("auto", "kernel"):
        return False
    if not f32_kernel_available():
        if route == "kernel":
            log.warning("--f32-linear kernel, but this CPU lacks AVX-512 and AVX2: library GEMMs instead")
        return False
    if route == "kernel":
        return True
    rival_name = "oneDNN" if onednn and torch.backends.mkldnn.is_available() else "F.linear"
    speeds = f32_linear_speeds(PackedLinear if rival_name == "oneDNN" else lambda m: m)
    kernel, rival = speeds["kernel"], speeds["rival"]
    decode_gain, prefill_gain = rival[0] / kernel[0], rival[1] / kernel[1]
    wanted = decode_gain >= KERNEL_MIN_DECODE_GAIN and prefill_gain >= KERNEL_MAX_PREFILL_LOSS
    log.info(
        "float32 linears: tokenfleet's kernel ran at %.2fx %s at %d rows and %.2fx at %d: %s "
        "(--f32-linear kernel|onednn|native decides instead)",
        decode_gain,
        rival_name,
        DECODE_ROWS,
        prefill_gain,
        PREFILL_ROWS,
        "taken, on weights packed at load" if wanted else "not taken",
    )
    return wanted
