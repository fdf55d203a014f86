"""Run a bench.compare workload through vLLM's offline engine; runs inside vLLM's own virtualenv.

Reads the workload as JSON on stdin ({"model", "dtype", "max_batch_size", "max_seq_len",
"requests": [{"prompt_ids", "max_new_tokens", "arrival_s"}]}) and writes the results as JSON to
the path given as the only argument (vLLM logs to stdout). Arrivals are honoured by adding
requests to the engine when their time comes (poisson); fixed and mixed arrive at once.
Never imports tokenfleet: the two virtualenvs have different packages.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import LLMEngine, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=spec["model"],
            dtype=spec["dtype"],
            max_model_len=spec["max_seq_len"],
            max_num_seqs=spec["max_batch_size"],
            seed=0,
            # the default (0.92 of RAM) refuses to start on a machine where anything else runs
            gpu_memory_utilization=spec.get("memory_utilization", 0.5),
        )
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    # warm up: one short request, so one-time setup is not timed
    engine.add_request("warmup", {"prompt_token_ids": [3, 4, 5]}, params(2))
    while engine.has_unfinished_requests():
        engine.step()

    requests = spec["requests"]
    submitted_at: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(requests) and requests[nxt]["arrival_s"] <= now:
            r = requests[nxt]
            rid = str(nxt)
            submitted_at[rid] = start + r["arrival_s"]
            token_times[rid] = []
            engine.add_request(rid, {"prompt_token_ids": r["prompt_ids"]}, params(r["max_new_tokens"]))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[nxt]["arrival_s"] - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            ids = out.outputs[0].token_ids
            stamp = time.perf_counter()
            times = token_times[out.request_id]
            times.extend([stamp] * (len(ids) - len(times)))
            if out.finished:
                outputs[out.request_id] = list(ids)
    wall = time.perf_counter() - start
    with open(sys.argv[1], "w") as f:
        f.write(
            json.dumps(
                {
                    "wall_s": wall,
                    "token_ids": [outputs[str(i)] for i in range(len(requests))],
                    "submitted_at": [submitted_at[str(i)] for i in range(len(requests))],
                    "token_times": [token_times[str(i)] for i in range(len(requests))],
                }
            )
        )


if __name__ == "__main__":
    main()
