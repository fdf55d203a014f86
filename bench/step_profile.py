"""Where a native engine step's time goes, per shape, dtype, phase and batch (issue 51's profile).

For each batch size, a prefill of that many ``--prompt-len``-token prompts and a decode step of that
many sequences at ``--prompt-len`` context run under ``torch.profiler``; each operator's own time
is put in a part:

- ``linears``: the projections (the C++ bf16/float32 kernels, oneDNN or ATen matmuls);
- ``head``: the output embedding (timed apart on the step's own hidden rows) and the argmax;
- ``attention``: the paged attention kernels (K/V written and read in place);
- ``layer_ops``: RMSNorm with its residual add, rotary, SiLU-and-multiply (one C++ pass each);
- ``other_ops``: every other operator (the embedding lookup, views, copies, step inputs);
- ``host``: the step's wall time less all operators' (Python, dispatch, waits).

The linears' and head's GFLOP/s hold them to the host's matmul speed. One JSON line per (phase,
batch), the host named in each::

    python -m bench.step_profile --model ~/.cache/tokenfleet/models/smollm2-bfloat16 --dtype bfloat16
    python -m bench.step_profile --size qwen2.5-0.5b --dtype bfloat16 --batches 8,16,32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import host_kind, model_or_built

LINEAR_OPS = (
    "tokenfleet::linear_bf16",
    "tokenfleet::linear_amx",
    "tokenfleet::linear_f32",
    "aten::mm",
    "aten::addmm",
    "mkldnn::",
)
ATTENTION_OPS = ("tokenfleet::paged_decode", "tokenfleet::paged_prefill", "tokenfleet::paged_attention")
LAYER_OPS = (
    "tokenfleet::rms_norm",
    "tokenfleet::add_rms_norm",
    "tokenfleet::rotary_",
    "tokenfleet::silu_and_mul",
)
WRAPPERS = ("aten::linear", "aten::matmul")  # their time is their children's (counted as linears)


def part_of(op: str) -> str:
    """Which part of a step operator ``op``'s own time belongs to."""
    if op.startswith(LINEAR_OPS):
        return "linears"
    if op.startswith(ATTENTION_OPS):
        return "attention"
    if op.startswith(LAYER_OPS):
        return "layer_ops"
    return "other_ops"


def profiled_ms(run: Callable[[], Any], repeats: int) -> tuple[float, dict[str, float]]:
    """``run``'s median wall time (ms) over ``repeats`` and its operators' own time per part (ms a run)."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            walls.append(time.perf_counter() - start)
    parts: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key.startswith(WRAPPERS):
            continue
        part = part_of(event.key)
        parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e3 / repeats
    return sorted(walls)[len(walls) // 2] * 1e3, parts


def layer_weights(cfg: Any) -> int:
    """Weights of a Llama/Qwen2-style model's projections, all layers (the step packs and fuses
    them, so they are counted from the config, not from the modules)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    attention = cfg.hidden_size * head_dim * (2 * cfg.num_attention_heads + 2 * kv_heads)
    return cfg.num_hidden_layers * (attention + 3 * cfg.hidden_size * cfg.intermediate_size)


def median_ms(run: Callable[[], Any], repeats: int) -> float:
    run()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
    return sorted(walls)[len(walls) // 2] * 1e3


def profile_phase(runner: Any, phase: str, batch: int, prompt_len: int, repeats: int) -> dict:
    """One JSON row: the step's wall time, its parts and the linears' speed."""
    import torch

    per_seq = -(-(prompt_len + repeats + 8) // runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[5 + (7 * i + j) % 1000 for j in range(prompt_len)] for i in range(batch)]
    runner.prefill(tables, prompts)  # the decode steps' context, and a warm-up
    steps = iter(range(1, 1 << 30))

    def step() -> Any:
        if phase == "prefill":
            return runner.prefill(tables, prompts).logits.argmax(-1).tolist()
        n = next(steps)  # each decode step one token further on
        return runner.decode(tables, [prompt_len + n] * batch, [7] * batch).argmax(-1).tolist()

    step()
    wall, parts = profiled_ms(step, repeats)
    hidden = torch.randn(batch, runner.model.config.hidden_size, dtype=runner.dtype)
    head = runner.model.get_output_embeddings()
    with torch.inference_mode():
        head_ms = median_ms(lambda: head(hidden), repeats)
        logits = head(hidden).float()
        argmax_ms = median_ms(lambda: logits.argmax(-1).tolist(), repeats)
    tokens = batch * (prompt_len if phase == "prefill" else 1)
    linear_flops = 2 * tokens * layer_weights(runner.model.config.get_text_config())
    head_in, head_out = head.in_features, head.out_features
    parts["linears"] = parts.get("linears", 0.0) - head_ms  # the head ran inside the step as a linear
    parts["head"] = head_ms + argmax_ms
    parts["other_ops"] = parts.get("other_ops", 0.0) - argmax_ms
    parts["host"] = wall - sum(parts.values())
    return {
        "phase": phase,
        "batch": batch,
        "tokens": tokens,
        "step_ms": round(wall, 2),
        "parts_ms": {k: round(v, 2) for k, v in sorted(parts.items())},
        "linears_gflop_s": round(linear_flops / parts["linears"] / 1e6, 1),
        "head_gflop_s": round(2 * batch * head_in * head_out / head_ms / 1e6, 1),
        "head_argmax_ms": round(argmax_ms, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="tiny", help="model built when --model is not given (model init's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="8,16,32", help="comma-separated batch sizes")
    p.add_argument("--phases", default="prefill,decode", help="comma-separated: prefill, decode")
    p.add_argument("--prompt-len", type=int, default=128, help="prefill: each prompt; decode: the context")
    p.add_argument("--repeats", type=int, default=10, help="profiled steps per row (the median is given)")
    args = p.parse_args()
    from tokenfleet.worker.process.malloc import arrange

    # the worker's allocator (tcmalloc where found): under glibc a prefill's large buffers are
    # mapped and faulted in afresh on every step, which a worker never pays
    arrange("auto", [sys.executable, "-m", "bench.step_profile", *sys.argv[1:]])

    import torch

    from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
    from tokenfleet.engines.native.runner import ModelRunner

    batches = [int(b) for b in args.batches.split(",")]
    model = model_or_built(args.model, args.size)
    per_seq = -(-(args.prompt_len + args.repeats + 8) // 16)
    kv = KVCacheConfig(block_size=16, num_blocks=max(batches) * per_seq + 1)
    runner = ModelRunner(
        EngineConfig(model=model, device="cpu", dtype=args.dtype),
        kv,
        DynamicBatchingConfig(max_batch_size=max(batches)),
    )
    facts = {"model": model, "dtype": args.dtype, "host": host_kind(), "threads": torch.get_num_threads()}
    for phase in args.phases.split(","):
        for batch in batches:
            row = profile_phase(runner, phase, batch, args.prompt_len, args.repeats)
            print(json.dumps({**facts, **row}), flush=True)


if __name__ == "__main__":
    main()
