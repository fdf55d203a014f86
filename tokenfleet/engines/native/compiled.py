"""``--compile``: the model compiled by inductor, once for decode (frozen weights, autotuned
matmuls, batches padded to :func:`~tokenfleet.engines.native.shapes.decode_buckets`) and once for
prefill (one graph with dynamic sizes: its gain is the fused norms, rotary and activations)."""

from __future__ import annotations

from typing import Any

import torch


def compile_decode(model: torch.nn.Module, device: torch.device, buckets: int) -> Any:
    """``model`` compiled for decode; inductor's GEMM templates are generated per shape, so
    batches are padded to one of ``buckets`` sizes."""
    import torch._inductor.config as inductor
    import torch.fx.experimental._config as fx_config

    inductor.freezing = True
    # dynamic prefill: without this, sizes equal at warm-up (2 prompts, 2 KV heads) are assumed
    # equal forever, and the first real batch recompiles mid-serving
    fx_config.use_duck_shape = False
    if device.type == "cpu":  # accelerators keep inductor's defaults (their vendor GEMMs)
        inductor.max_autotune = True
        inductor.max_autotune_gemm_backends = "CPP,ATEN"
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * buckets)
    return torch.compile(model, dynamic=False, options={"guard_filter_fn": keep_guards})


def compile_prefill(model: torch.nn.Module) -> Any:
    return torch.compile(model, dynamic=True, options={"max_autotune": False, "guard_filter_fn": keep_guards})


def keep_guards(entries: list[Any]) -> list[bool]:
    """Which of a compiled graph's guards run before every call: all but those on the model's
    modules, whose hooks and attributes the engine never changes after loading (a third of the
    guard check's time). Every parameter's identity stays checked: frozen into the graph, they
    tie it to this model, so another engine's model of the same class never runs it."""
    return [
        not e.orig_guard.source.is_unspecialized_nn_module() or e.guard_type == "ID_MATCH" for e in entries
    ]
