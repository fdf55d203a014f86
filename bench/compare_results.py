"""bench.compare's results: rounds combined into one row per system, and the JSON and Markdown
table written.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path

from bench.workload import Req


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """Share of tokens generated before each request first differs from HF generate's (1.0: all
    equal). Random-weight models in bf16 have many near-ties, so kernels that sum in another order
    can part ways; fp32 runs agree fully (tests check that)."""
    same = total = 0
    for g, e in zip(got, expected):
        n = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
        same, total = same + n, total + len(g)
    return same / total if total else 0.0


def combine_rounds(rows: list[str], by_round: list[dict[str, dict]]) -> list[dict]:
    """One row per system: its median round by tokens/s (the lower middle one for an even number
    of rounds; that round's latencies with it), every round's tokens/s, and ``vs_vllm_best`` as
    the median of the ratios taken within each round (pairs that ran minutes apart, not hours),
    so a slow spell of the host hits both sides."""
    results = []
    for name in rows:
        runs = [r[name] for r in by_round if name in r]
        if not runs:
            continue
        ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
        ratios = [
            r[name]["tokens_per_s"] / r["vllm-best"]["tokens_per_s"]
            for r in by_round
            if name in r and "vllm-best" in r
        ]
        row["vs_vllm_best"] = round(statistics.median(ratios), 3) if ratios else None
        row["vs_vllm_best_rounds"] = [round(x, 3) for x in ratios]
        results.append(row)
    return results


def scale(row: dict, reqs: list[Req]) -> float:
    """Rows that ran a subset of the workload (hf-generate-b1) are held to that subset's share."""
    return row["generated_tokens"] / sum(r.max_new_tokens for r in reqs)


def device_name(device: str) -> str:
    import torch

    return cpu_name() if device == "cpu" else torch.cuda.get_device_name(torch.device(device))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write(args, meta: dict, results: list[dict], by_round: list[dict[str, dict]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{meta['size'] or Path(meta['model']).name}-{meta['dtype']}-{meta['workload']}"
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "rows": results, "rounds": by_round}, indent=1)
    )
    on_cpu = meta.get("device", meta["cpu"]) == meta["cpu"]
    # results written before the prepacked oneDNN GEMM joined the measurement lack the key
    onednn = meta.get("matmul_onednn")
    gemm_rules = "; the best of a plain matmul and oneDNN on a prepacked weight" if onednn else ""
    if meta["dtype"] == "bfloat16":
        gemm_rules += "; bf16: the fastest of bf16 and float32 GEMMs"
        gemm_rules += " and tokenfleet's bf16 kernel" if meta.get("matmul_kernel") else ""
    per_row = meta.get("roofline_per_row")
    header = (
        f"{meta['workload']} workload, {meta['requests']} requests, {meta['dtype']}, "
        f"{meta['size'] or meta['model']}; {meta.get('device', meta['cpu'])}, {meta['threads']} CPU threads, "
        f"torch {meta['torch']}. "
        f"Matmul GFLOP/s{' before the first row' if per_row else ''}: "
        f"{meta['matmul_flops_per_s_prefill_shapes']} (prefill shapes, M={meta['prefill_m']}), "
        f"{meta['matmul_flops_per_s_decode_shapes']} (decode shapes, M={meta['decode_m']}), "
        f"{meta['matmul_flops_per_s_peak']} (peak){gemm_rules if on_cpu else ''}. "
    )
    if per_row:
        ranges = {k: f"{min(v):g}-{max(v):g}" for k, v in meta["matmul_gflops_measured"].items()}
        header += (
            "Measured again after every row, and each row's roofline and peak are the means of "
            "those measured right before and right after it (the host drifts); across the run: "
            f"{ranges['matmul_flops_per_s_prefill_shapes']} (prefill shapes), "
            f"{ranges['matmul_flops_per_s_decode_shapes']} (decode shapes), "
            f"{ranges['matmul_flops_per_s_peak']} (peak). host GFLOP/s: the decode shapes' speed "
            "around the row."
        )
    else:  # results from before the roofline was measured around every row
        header += (
            f"host GFLOP/s: a {meta['decode_m']}x{meta['probe_shape'][0]}x{meta['probe_shape'][1]} "
            "matmul right before the row, to show the host's drift."
        )
    if meta.get("bf16_linear"):
        header += f" tokenfleet's bf16 linears: {meta['bf16_linear']} (chosen once for every tokenfleet row)."
    if meta["rounds"] > 1:
        header += (
            f" {meta['rounds']} rounds, round robin: each row is its median round; vs vLLM is the "
            "median of the ratios within each round."
        )
    columns = ["system", "tokens/s", "vs vLLM best", "roofline", "peak", "TTFT mean ms", "TTFT p50 ms"]
    columns += ["TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "= HF", "agree", "host GFLOP/s"]
    columns += ["CPU s: client / Redis / worker", "note"]
    if meta["rounds"] > 1:
        columns[3:3] = ["rounds: tokens/s", "rounds: vs vLLM"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        vs = "" if r["vs_vllm_best"] is None else f"{r['vs_vllm_best']:.2f}x"
        cells = [r["system"], r["tokens_per_s"], vs, f"{r['roofline']:.0%}", f"{r['peak']:.0%}"]
        cells += [r["ttft_mean_ms"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"]]
        cells += [f"{r['match_hf']}/{r['requests']}", f"{r['agree_hf']:.0%}", r["host_gflops"]]
        cpu = ("client_cpu_s", "redis_cpu_s", "worker_cpu_s")
        cells += [" / ".join(f"{r[k]:g}" for k in cpu) if cpu[0] in r else "", r["note"]]
        if meta["rounds"] > 1:
            rounds = " / ".join(f"{x:g}" for x in r["rounds_tokens_per_s"])
            cells[3:3] = [rounds, " / ".join(f"{x:.2f}" for x in r["vs_vllm_best_rounds"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    table = "\n".join(lines)
    (out / f"{stem}.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwritten: {out / stem}.json and .md", file=sys.stderr)
