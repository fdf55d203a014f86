"""bf16 linears on AMX tiles for decode-sized calls (``csrc/linear_amx_cpu.cpp``), oneDNN's GEMM
for prefill-sized ones; whether this CPU has it, and whether ``--bf16-linear auto`` takes it.

On AMX Xeons oneDNN's tile GEMM is the fastest thing there is for thousands of rows, but at a
decode step's few rows it waits on the weights; the kernel, on a weight packed in the order its
tiles are used, streams them (figures in docs/PERFORMANCE.md).
The original weight is kept for the prefill calls (shared with a tied embedding, not copied), so
the route holds the linear weights twice.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenfleet.engines.native.kernels.loader import load_kernels
from tokenfleet.engines.native.kv_sizing import available_memory_bytes
from tokenfleet.engines.native.linear.bf16 import native_bf16_linear
from tokenfleet.engines.native.linear.onednn import DECODE_ROWS_HINT
from tokenfleet.engines.native.linear.race import Layer, race_routes

# Rows up to which the tiles beat F.linear (oneDNN): once a weight is reused over enough rows,
# oneDNN's blocking wins (the crossover measured in docs/PERFORMANCE.md)
AMX_MAX_ROWS = 256
AMX_MIN_DECODE_GAIN = 1.05  # auto takes the tiles when at least this much faster at decode rows
AMX_MAX_MEMORY_SHARE = 0.5  # ... and the packed copies fit in this share of the free memory

log = logging.getLogger(__name__)


class AmxLinear(nn.Module):
    """A bf16 ``nn.Linear`` computed on AMX tiles over a packed copy of its weight for calls of up
    to :data:`AMX_MAX_ROWS` rows, and by ``F.linear`` on the original weight above."""

    DTYPES = (torch.bfloat16,)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # prefill's; the same tensor as a tied embedding's
        self.bias = linear.bias
        packed = torch.ops.tokenfleet.pack_linear_amx(linear.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        # the tiles' sums are float32: the bias is added to them before the one rounding
        tile_bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("tile_bias", tile_bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= AMX_MAX_ROWS * self.in_features:
            return torch.ops.tokenfleet.linear_amx(x, self.packed_weight, self.out_features, self.tile_bias)
        return F.linear(x, self.weight, self.bias)


def amx_kernel_available() -> bool:
    """Whether ``tokenfleet::linear_amx`` runs here: built with AMX-BF16 and given the tile state."""
    if load_kernels() is None:
        return False
    try:
        packed = torch.ops.tokenfleet.pack_linear_amx(torch.ones(2, 2, dtype=torch.bfloat16))
        torch.ops.tokenfleet.linear_amx(torch.ones(1, 2, dtype=torch.bfloat16), packed, 2, None)
    except RuntimeError:  # built without AMX, or the kernel refused the tile state
        return False
    return True


def amx_speedup(size: int = 1024, weights: int = 12, rounds: int = 5) -> float:
    """How many times faster the tiles run a ``size`` x ``size`` bf16 linear than oneDNN on a
    prepacked weight at 32 rows, through ``weights`` weights in turn (24 MB: from memory, as a
    decode step reads them); the two take turns within each round. ~0.2 s."""
    layers = [nn.Linear(size, size, bias=False, dtype=torch.bfloat16) for _ in range(weights)]
    routes: dict[str, list[Layer]] = {
        "amx": [AmxLinear(layer) for layer in layers],
        "onednn": [native_bf16_linear(layer.weight.detach()) for layer in layers],
    }
    x = torch.randn(DECODE_ROWS_HINT, size).to(torch.bfloat16)
    speeds = race_routes(routes, x, x, rounds)
    return speeds["onednn"][0] / speeds["amx"][0]


def packed_bytes(linears: list[nn.Linear]) -> int:
    """The memory the packed copies of ``linears`` take (padded to 32 x 32 tiles)."""
    return sum(-(-lin.out_features // 32) * -(-lin.in_features // 32) * 32 * 32 * 2 for lin in linears)


def amx_wanted(device: torch.device, dtype: torch.dtype, route: str, linears: list[nn.Linear]) -> bool:
    """Whether a bf16 model's ``linears`` take :class:`AmxLinear`: ``route`` ``amx`` asks for it
    (where it runs), ``auto`` where it is faster at decode rows and its copies fit in memory."""
    if device.type != "cpu" or dtype != torch.bfloat16 or route not in ("auto", "amx"):
        return False
    if not amx_kernel_available():
        if route == "amx":
            log.warning(
                "--bf16-linear amx, but this CPU (or its kernel) gives no AMX-BF16: other routes instead"
            )
        return False
    if route == "amx":
        return True
    extra, free = packed_bytes(linears), available_memory_bytes()
    if free is not None and extra > free * AMX_MAX_MEMORY_SHARE:
        log.info(
            "bf16 linears: AMX tiles would take %.1f GiB more of %.1f GiB free: not taken "
            "(--bf16-linear amx forces them)",
            extra / 2**30,
            free / 2**30,
        )
        return False
    gain = amx_speedup()
    wanted = gain >= AMX_MIN_DECODE_GAIN
    log.info(
        "bf16 linears: AMX tiles ran at %.2fx oneDNN's GEMM at %d rows: %s (--bf16-linear decides instead)",
        gain,
        DECODE_ROWS_HINT,
        f"taken for calls of up to {AMX_MAX_ROWS} rows, on copies packed at load ({extra / 2**20:.0f} MiB)"
        if wanted
        else "not taken",
    )
    return wanted
