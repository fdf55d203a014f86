"""Device and dtype selection: ``auto``, ``cpu``, ``cuda[:N]``, ``npu[:N]``.

``torch_npu`` is imported only when an NPU is asked for (or probed by ``auto``), so CPU and CUDA
installs never need it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# below this bf16/float32 matmul speed ratio, bf16 linears run on float32 GEMMs (cpu_linear)
BF16_SLOWER_HINT = 0.8

log = logging.getLogger(__name__)


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    npu = getattr(torch, "npu", None)  # torch_npu adds it
    return bool(npu and npu.is_available())


def select_device(name: str = "auto") -> torch.device:
    """Resolve a device name; raises ``ValueError`` with a one-line reason when it cannot be had."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    kind = name.split(":", 1)[0]
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise ValueError(
                "device npu needs torch_npu: pip install 'tokenfleet[npu]' (Ascend CANN required)"
            )
        importlib.import_module("torch_npu")
        if not getattr(torch, "npu").is_available():  # noqa: B009 (torch_npu adds it)
            raise ValueError("torch_npu is installed but no Ascend NPU is visible")
    elif kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda asked for, but torch sees no CUDA GPU")
    elif kind != "cpu":
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda[:N] or npu[:N]")
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 matmul instructions (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_matmul_speed(rows: int = 64, size: int = 1024, rounds: int = 5) -> float:
    """bf16 matmul throughput over float32's on this CPU (a few ms): ``rows`` tokens through a
    ``size`` x ``size`` weight, the best of ``rounds`` for each."""

    def best_seconds(dtype: torch.dtype) -> float:
        x, w = torch.randn(rows, size).to(dtype), torch.randn(size, size).to(dtype)
        x @ w  # the library picks and prepares its kernel on the first call
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            x @ w
            times.append(time.perf_counter() - start)
        return min(times)

    return best_seconds(torch.float32) / best_seconds(torch.bfloat16)


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on accelerators and on CPUs with native bf16, float32 otherwise.

    Native bf16 is not always the faster one: some CPUs run float32 matmuls (MKL, oneDNN) at up
    to twice the bf16 rate. bf16 stays the choice (half the memory for KV cache and activations,
    and the same dtype on every worker of a fleet, whatever a timing says); the engine then runs
    its linears on float32 GEMMs (see ``cpu_linear``), which compute the same products."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
        if name == "bfloat16" and device.type == "cpu" and not cpu_supports_bf16():
            from tokenfleet.engines.native.linear.bf16 import bf16_kernel_available

            if bf16_kernel_available():  # AVX-512 or AVX2: float32 FMAs on bf16 weights, half the memory
                log.info(
                    "dtype bfloat16 on a CPU without bf16 instructions (AVX512-BF16 or AMX): library "
                    "bf16 matmuls ran at %.2fx float32's here, so linears take tokenfleet's bf16 "
                    "kernel or float32 GEMMs; --dtype auto picks float32 on this CPU",
                    bf16_matmul_speed(),
                )
                return DTYPES[name]
            # taken as asked (a fleet may want one dtype), but emulated bf16 is a trap: say so
            log.warning(
                "dtype bfloat16 on a CPU without bf16 instructions (AVX512-BF16 or AMX): its matmuls "
                "are emulated and ran at %.2fx float32's here; --dtype auto picks float32 on this CPU",
                bf16_matmul_speed(),
            )
        return DTYPES[name]
    if device.type in ("cuda", "npu"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32
