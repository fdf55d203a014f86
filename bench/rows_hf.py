"""bench.compare's Hugging Face rows: ``generate`` one request at a time, in one padded batch, and
through transformers' continuous batching manager.
"""

from __future__ import annotations

import time

from bench.workload import Req, Stamper, Trace, summarize, wait_until


def load_hf(model_dir: str, dtype: str, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.eval().to(device)


def run_hf_b1(model, reqs: list[Req], limit: int) -> dict:
    import torch

    reqs = reqs[:limit]
    traces = [Trace(0.0) for _ in reqs]
    with torch.inference_mode():
        warm = torch.tensor([reqs[0].prompt_ids[:8]], device=model.device)
        model.generate(warm, max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for req, trace in zip(reqs, traces):
            trace.arrival = start + req.arrival_s
            wait_until(trace.arrival)
            model.generate(
                torch.tensor([req.prompt_ids], device=model.device),
                max_new_tokens=req.max_new_tokens,
                min_new_tokens=req.max_new_tokens,
                do_sample=False,
                streamer=Stamper([trace]),
            )
    return summarize(
        "hf-generate-b1", traces, time.perf_counter() - start, f"first {len(reqs)} requests, one at a time"
    )


def run_hf_batch(model, reqs: list[Req], pad_id: int) -> dict:
    import torch

    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(reqs):  # left padding, as generate wants for decoder-only models
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    longest = max(r.max_new_tokens for r in reqs)
    traces = [Trace(0.0) for _ in reqs]
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for req, trace in zip(reqs, traces):
            trace.arrival = start + req.arrival_s
        wait_until(max(t.arrival for t in traces))  # a static batch starts when its last request is in
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=Stamper(traces),
        )
    wall = time.perf_counter() - start
    for req, trace in zip(reqs, traces):  # the batch runs to its longest request; each keeps its own
        trace.token_ids, trace.token_times = (
            trace.token_ids[: req.max_new_tokens],
            trace.token_times[: req.max_new_tokens],
        )
    return summarize("hf-generate-batch", traces, wall, f"one generate of {len(reqs)}, padded to {width}")


def run_hf_cb(model, reqs: list[Req], max_batch_size: int) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_new_tokens for r in reqs)
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        warm = manager.add_request([3, 4, 5], max_new_tokens=2, eos_token_id=-1)
        manager.get_result(request_id=warm, timeout=300)
        traces = [Trace(0.0) for _ in reqs]
        start = time.perf_counter()
        ids = {}
        for i, (req, trace) in enumerate(zip(reqs, traces)):
            trace.arrival = start + req.arrival_s
            wait_until(trace.arrival)
            ids[
                manager.add_request(
                    req.prompt_ids,
                    request_id=f"r{i}",
                    max_new_tokens=req.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            ] = trace
        done = 0
        while done < len(reqs):
            out = manager.get_result(timeout=300)
            if out is None or not out.is_finished():
                continue
            trace = ids[out.request_id]
            trace.token_ids = list(out.generated_tokens)
            trace.token_times = list(out.timestamps or [])
            done += 1
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return summarize("hf-generate-batch-cb", traces, wall, "transformers ContinuousBatchingManager")
