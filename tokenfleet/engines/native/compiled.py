"""``--compile``: the model compiled by inductor, once for decode (frozen weights, autotuned
matmuls, batches padded to :func:`~tokenfleet.engines.native.shapes.decode_buckets`) and once for
prefill (one graph with dynamic sizes: its gain is the fused norms, rotary and activations)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenfleet.engines.native.runner import ModelRunner

log = logging.getLogger(__name__)


def compile_steps(model: Any, device: torch.device, buckets: int, wanted: bool) -> tuple[Any, Any]:
    """``model``'s base compiled for decode and for prefill where ``wanted``; else neither."""
    if not wanted:
        return None, None
    return compile_decode(model.base_model, device, buckets), compile_prefill(model.base_model)


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


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> float:
    """Compile prefill and every decode bucket before serving (through the runner's ``prefill``
    and ``decode`` themselves, on throwaway sequences two blocks long, so the compiled code's
    guards match real steps), and capture decode's CUDA graphs; returns the seconds it took."""
    if runner.graphs is None and runner.compiled_decode is None:
        return 0.0  # nothing to warm: no log line either
    start = time.perf_counter()
    if runner.graphs is not None:
        log.info("capturing decode as CUDA graphs (once per worker start)")
        runner.graphs.capture(lambda ids, pos, meta: runner.logits(runner.forward(ids, pos, meta)[:, -1]))
    if runner.compiled_decode is None:
        return time.perf_counter() - start
    tokens = runner.block_size + 1  # two blocks each: blocks 2i and 2i+1, nothing else runs yet
    pad = runner.pad_token_id
    log.info("compiling prefill (once per worker start)")
    runner.prefill([[0, 1], [2, 3]], [[pad] * tokens] * 2)
    for rows in runner.decode_buckets:
        log.info("compiling decode for batches up to %d (once per worker start)", rows)
        n = min(rows, runner.num_blocks // 2)
        runner.decode([[2 * i, 2 * i + 1] for i in range(n)], [tokens] * n, [pad] * n)
    return time.perf_counter() - start
