"""Linears on the CPU: which GEMM computes them, chosen at load.

Four routes, named as ``--bf16-linear`` names them:

- ``amx``: :class:`~tokenfleet.engines.native.linear.amx.AmxLinear`, tokenfleet's AMX tile kernel
  (``csrc/linear_amx_cpu.cpp``) on a copy packed at load for decode-sized calls, oneDNN's GEMM on
  the original weight for prefill-sized ones. AMX Xeons only.

- ``float32``: :class:`~tokenfleet.engines.native.linear.onednn.PackedLinear`, oneDNN on a weight
  reordered once at load (no second copy). Always for float32 models (faster than ``F.linear``'s
  MKL GEMM at decode shapes); for bf16 ones where this CPU's float32 GEMM outruns its bf16 one.
  The arithmetic is a bf16 GEMM's (bf16 inputs widen exactly, float32 sums, output rounded to
  bf16); the weight is held in float32.
- ``kernel``: :class:`~tokenfleet.engines.native.linear.bf16.KernelLinear`, tokenfleet's bf16 GEMM
  (``csrc/linear_bf16_cpu.cpp``) on a weight packed at load: VDPBF16PS with AVX512-BF16, float32
  FMAs on widened weights otherwise.
- ``native``: the model's own linears, left as they are.

``auto`` times the routes at start-up: the AMX tiles where they beat oneDNN at decode rows, else
the kernel where it is fastest at decode rows and not much slower at prefill rows.
docs/PERFORMANCE.md has the measurements behind these rules.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from tokenfleet.engines.native.device import BF16_SLOWER_HINT, bf16_matmul_speed
from tokenfleet.engines.native.kv_sizing import available_memory_bytes
from tokenfleet.engines.native.linear.amx import AmxLinear, amx_wanted
from tokenfleet.engines.native.linear.bf16 import KernelLinear, bf16_kernel_available, bf16_linear_speeds
from tokenfleet.engines.native.linear.f32 import F32KernelLinear, f32_kernel_wanted
from tokenfleet.engines.native.linear.onednn import DECODE_ROWS_HINT, PackedLinear

KERNEL_MIN_DECODE_GAIN = 1.0  # auto takes the kernel when at least as fast at 32 rows ...
KERNEL_MAX_PREFILL_LOSS = 0.95  # ... and at least this fast as the best other at 512 rows,
KERNEL_MAX_PREFILL_LOSS_VS_FLOAT32 = 0.8  # or this fast where that is the float32 copy

log = logging.getLogger(__name__)


def bf16_kernel_wanted(device: torch.device, dtype: torch.dtype, route: str = "auto") -> bool:
    """Whether a bf16 model's linears take :class:`KernelLinear`: ``route`` ``kernel`` asks for
    it (where it is built), ``auto`` measures it against oneDNN's bf16 and float32 GEMMs."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if route not in ("auto", "kernel"):
        return False
    if not bf16_kernel_available():
        if route == "kernel":
            log.warning("--bf16-linear kernel, but this CPU lacks AVX-512 and AVX2: oneDNN GEMMs instead")
        return False
    if route == "kernel":
        return True
    speeds = bf16_linear_speeds()
    kernel = speeds.pop("kernel")
    decode_gain = min(t[0] for t in speeds.values()) / kernel[0]
    prefill_rival = min(speeds, key=lambda name: speeds[name][1])
    prefill_gain = speeds[prefill_rival][1] / kernel[1]
    # the float32 route holds every weight at twice the bytes: a slower prefill buys half the memory
    bar = KERNEL_MAX_PREFILL_LOSS_VS_FLOAT32 if prefill_rival == "float32" else KERNEL_MAX_PREFILL_LOSS
    wanted = decode_gain >= KERNEL_MIN_DECODE_GAIN and prefill_gain >= bar
    log.info(
        "bf16 linears: tokenfleet's kernel ran at %.2fx the fastest oneDNN GEMM at %d rows "
        "and %.2fx at 512: %s (--bf16-linear kernel|native|float32 decides instead)",
        decode_gain,
        DECODE_ROWS_HINT,
        prefill_gain,
        "taken, on weights packed at load" if wanted else "not taken",
    )
    return wanted


def linear_route(
    device: torch.device,
    dtype: torch.dtype,
    model: nn.Module | None = None,
    bf16_route: str = "auto",
    onednn: bool = True,
    f32_route: str = "auto",
) -> str:
    """The route a model's linears take on ``device`` in ``dtype``, named as ``--bf16-linear``
    names them: ``amx`` (:class:`AmxLinear`), ``kernel`` (tokenfleet's: :class:`KernelLinear` for bf16,
    :class:`~tokenfleet.engines.native.linear.f32.F32KernelLinear` for float32), ``float32``
    (:class:`PackedLinear`, oneDNN float32 GEMMs) or ``native`` (left as they are).
    ``bf16_route`` / ``f32_route`` are what was asked for a bf16 / float32 model (``auto``:
    measured); ``onednn`` False keeps ``F.linear`` where the kernel is not taken."""
    linears = (
        [child for _, _, child in swappable_linears(model, AmxLinear.DTYPES)] if model is not None else []
    )
    if amx_wanted(device, dtype, bf16_route, linears):
        return "amx"
    if bf16_kernel_wanted(device, dtype, bf16_route) or f32_kernel_wanted(device, dtype, f32_route, onednn):
        return "kernel"
    if dtype == torch.float32 and f32_route == "native":
        return "native"
    return "float32" if onednn_linears_wanted(device, dtype, model, bf16_route, onednn) else "native"


def onednn_linears_wanted(
    device: torch.device,
    dtype: torch.dtype,
    model: nn.Module | None = None,
    route: str = "auto",
    onednn: bool = True,
) -> bool:
    """float32 always (on the CPU, with oneDNN); bf16 when float32 GEMMs are the faster here and
    (under ``auto``) the float32 copies of ``model``'s linear weights fit in half the free memory."""
    if not (onednn and device.type == "cpu" and torch.backends.mkldnn.is_available()):
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    if route != "auto":
        return route == "float32"
    speed = bf16_matmul_speed()
    if speed >= BF16_SLOWER_HINT:
        return False
    # a float32 weight takes 2 bytes an element more than its bf16 original; a tied one, 4 more
    extra = 0
    if model is not None:
        for _, _, child in swappable_linears(model):
            extra += child.weight.numel() * (4 if is_tied(model, child) else 2)
    free = available_memory_bytes()
    if free is not None and extra > free / 2:
        log.info(
            "bf16 matmuls run at %.2fx float32's on this CPU, but float32 weights would take %.1f GiB "
            "more of %.1f GiB free: linears stay on bf16 GEMMs (--bf16-linear float32 forces it)",
            speed,
            extra / 2**30,
            free / 2**30,
        )
        return False
    log.info(
        "bf16 matmuls run at %.2fx float32's on this CPU: linears compute on float32 GEMMs "
        "(the same products and float32 sums, outputs rounded to bf16; weights held in float32, "
        "%.1f GiB more). --bf16-linear native keeps bf16 GEMMs",
        speed,
        extra / 2**30,
    )
    return True


def swappable_linears(
    model: nn.Module, dtypes: tuple[torch.dtype, ...] = PackedLinear.DTYPES
) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every ``nn.Linear`` of ``model`` with a weight of one of
    ``dtypes``. A tied output embedding is one: its packed copy is its own, the input embedding
    keeps the weight (a plain matmul on the tied [vocab, hidden] weight took 60 ms of a 236 ms
    batch-32 decode step of SmolLM2 in float32 on an EPYC AVX2; prepacked, 21 ms)."""
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype in dtypes
    ]


def is_tied(model: nn.Module, linear: nn.Linear) -> bool:
    """Whether another module of ``model`` uses ``linear``'s weight (a tied output embedding)."""
    users = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return users[id(linear.weight)] > 1


def pack_linears(
    model: nn.Module, kind: type[PackedLinear | KernelLinear | F32KernelLinear | AmxLinear] = PackedLinear
) -> int:
    """Swap each of :func:`swappable_linears` whose dtype ``kind`` takes for a ``kind``
    (:class:`PackedLinear`, :class:`KernelLinear`, :class:`F32KernelLinear` or :class:`AmxLinear`);
    returns how many."""
    swaps = swappable_linears(model, kind.DTYPES)
    for parent, name, child in swaps:
        setattr(parent, name, kind(child))
    return len(swaps)


def pack_for_route(model: nn.Module, route: str, dtype: torch.dtype) -> None:
    """Swap ``model``'s linears for the kind :func:`linear_route`'s ``route`` names (``native``:
    none), and log how many."""
    if route == "amx":
        log.info("engine: %d linears on AMX tiles for decode rows, packed", pack_linears(model, AmxLinear))
    elif route == "kernel":
        count = pack_linears(model, KernelLinear if dtype == torch.bfloat16 else F32KernelLinear)
        log.info(
            "engine: %d linears on tokenfleet's %s kernel, packed", count, str(dtype).removeprefix("torch.")
        )
    elif route == "float32":
        log.info("engine: %d linears on oneDNN float32 GEMMs, prepacked", pack_linears(model))
