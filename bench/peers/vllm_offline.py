"""Run a bench.compare workload through vLLM's offline engine; runs inside vLLM's own virtualenv.

Reads the workload as JSON on stdin ({"model", "dtype", "max_batch_size", "max_seq_len",
"requests": [{"prompt_ids", "max_new_tokens", "arrival_s", optional "adapter"}], optional
"loras": {name: directory, ...} with "max_lora_rank"}, or "chat": {"system", "users",
"new_tokens"} for bench.chat's turns) and writes the results as JSON to the path given as the only
argument (vLLM logs to stdout). Arrivals are honoured by adding
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
            **lora_args(spec),
        )
    )
    loras = lora_requests(spec)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    # warm up: one short request, so one-time setup is not timed
    engine.add_request("warmup", {"prompt_token_ids": [3, 4, 5]}, params(2))
    for name, lora in loras.items():  # every adapter loaded before the clock starts
        engine.add_request(f"warmup-{name}", {"prompt_token_ids": [3, 4, 5]}, params(2), lora_request=lora)
    while engine.has_unfinished_requests():
        engine.step()

    if "chat" in spec:
        with open(sys.argv[1], "w") as f:
            f.write(json.dumps({"turns": run_chat(engine, spec["chat"], params)}))
        return

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
            lora = loras.get(r.get("adapter"))
            engine.add_request(
                rid, {"prompt_token_ids": r["prompt_ids"]}, params(r["max_new_tokens"]), lora_request=lora
            )
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


def lora_args(spec: dict) -> dict:
    """vLLM's LoRA settings where the workload names adapters: every one resident at once."""
    if not spec.get("loras"):
        return {}
    return {"enable_lora": True, "max_loras": len(spec["loras"]), "max_lora_rank": spec["max_lora_rank"]}


def lora_requests(spec: dict) -> dict:
    """A ``LoRARequest`` per adapter the workload names (warmed by the first request using it)."""
    if not spec.get("loras"):
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec["loras"].items())}


def run_chat(engine, chat: dict, params) -> list[dict]:
    """bench.chat's turns on one engine (its prefix cache kept between them): every chat's prompt
    at once (system prompt, its history with its own earlier answers, the new message), every
    answer before the next turn."""
    answers: list[list[list[int]]] = []
    turns = []
    for turn, users in enumerate(chat["users"]):
        prompts = []
        for i, user in enumerate(users):
            ids = list(chat["system"])
            for earlier in range(turn):
                ids += chat["users"][earlier][i] + answers[earlier][i]
            prompts.append(ids + user)
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(f"t{turn}-{i}", {"prompt_token_ids": ids}, params(chat["new_tokens"]))
        first: dict[str, float] = {}
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        wall = time.perf_counter() - start
        ids = [outputs[f"t{turn}-{i}"] for i in range(len(prompts))]
        answers.append(ids)
        ttft = [(first[f"t{turn}-{i}"] - start) * 1000 for i in range(len(prompts))]
        turns.append({"wall_s": wall, "ttft_ms": ttft, "token_ids": ids})
    return turns


if __name__ == "__main__":
    main()
