"""Constrained decoding's cost: 32 chat requests under one JSON schema against the same requests
unconstrained, on the native engine in this process, rounds taking turns.

    python -m bench.structured --model DIR --dtype bfloat16 --rounds 6
    python -m bench.compare --workload structured --model DIR --dtype bfloat16   (the same)

Each round runs the constrained burst (all 32 at once, continuous batching, greedy), the same
prompts unconstrained, each held to the length its constrained twin reached (EOS ignored), and
the constrained burst with every row masked first, each of the three first in turn by round:
both sides generate the same number of tokens in batches of the same shape, so the ratio of
their tokens/s is the grammar's cost alone. The grammar's time per sequence per step, from the
engine's own record: its CPU time (the checks of tokens drawn without a mask, and the full masks
of the rows the grammar refused, as the OS counts llguidance's threads), the share of rows that
needed a full mask, and how long each step spent on the grammar after its forward pass. For
comparison, full masks replayed along the constrained outputs with nothing else running: every
live row masked at every step (all in one llguidance call, as the engine did before it checked
first), and each mask alone on one thread (llguidance's own speed); and the constrained burst
served that way too (``ratio_every_row_masked_first``: the same tokens, the simpler policy).
Prints one JSON line per round and a summary line with the host. Never a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import code_commit, host_kind, model_or_built, percentile, pin_bf16_linear_route

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a painter", "a sailor", "a baker", "a pilot", "a nurse", "a farmer", "a poet", "a coder"]


def burst(runner, batching, grammars, requests) -> tuple[list[list[int]], float]:
    """Serve ``requests`` at once on a core of their own (no prefix cache from the last burst) with
    ``grammars``, the compiled grammars a worker keeps for life; their tokens and the wall time."""
    from tokenfleet.core.offline import finished_in, run_offline
    from tokenfleet.core.sequence import SeqState
    from tokenfleet.engines.native.core import NativeCore

    core = NativeCore(runner, batching)
    core.grammars = grammars
    seqs = []
    for i, request in enumerate(requests):
        matcher = core.output_constraint(request)
        assert not hasattr(matcher, "code"), matcher  # a refusal: the schema must compile
        ids = list(request.input_ids)
        seqs.append(
            SeqState(i, request, ids, runner.tokenizer, runner.eos_token_ids, time.time(), matcher=matcher)
        )
    start = time.perf_counter()
    finished_in(run_offline(core, [(0.0, seq) for seq in seqs]))
    return [list(seq.generated) for seq in seqs], time.perf_counter() - start


def replay_masks(runner, grammars, requests, outputs) -> tuple[list[float], list[float]]:
    """The constrained burst's masks computed again along its outputs, with nothing else running:
    step by step with every live row masked (llguidance's executor, all in one call), the
    microseconds per sequence of each step's fill; then each mask alone, the microseconds of each."""
    import llguidance
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

    executor = llguidance.LLExecutor()
    matchers = [grammars.matcher(request.response_format) for request in requests]
    per_step = []
    for step in range(max(len(tokens) for tokens in outputs)):
        live = [i for i, tokens in enumerate(outputs) if step < len(tokens)]
        bits = allocate_token_bitmask(len(live), runner.vocab_size)
        began = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(matchers[i], k) for k, i in enumerate(live)], bits)
        per_step.append((time.perf_counter() - began) / len(live) * 1e6)
        for i in live:
            matchers[i].consume_token(outputs[i][step])
    one = allocate_token_bitmask(1, runner.vocab_size)
    row_bytes = one.shape[1] * one.element_size()
    per_mask = []
    for request, tokens in zip(requests, outputs):
        matcher = grammars.matcher(request.response_format)
        for token in tokens:
            began = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(one.data_ptr(), row_bytes)
            per_mask.append((time.perf_counter() - began) * 1e6)
            if not matcher.consume_token(token):
                break
    return per_step, per_mask


def percentiles(name: str, values: list[float], *ps: int) -> dict[str, float]:
    """``{name_pP: value}`` for each P, to 0.1."""
    return {f"{name}_p{p}": round(percentile(values, p) or 0, 1) for p in ps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a random small model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)

    from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
    from tokenfleet.core.vocab import render_chat
    from tokenfleet.engines.native.core import NativeCore
    from tokenfleet.engines.native.runner import ModelRunner
    from tokenfleet.protocol import Request
    from tokenfleet.protocol.output_controls import parse_response_format

    model = model_or_built(args.model, "small")
    pin_bf16_linear_route(args.dtype)
    runner = ModelRunner(
        EngineConfig(model=model, dtype=args.dtype),
        KVCacheConfig(num_blocks=64 * args.requests),
        DynamicBatchingConfig(max_batch_size=32),
    )
    runner.warm_up()
    batching = DynamicBatchingConfig(
        mode="continuous", max_wait_ms=0, max_batch_size=32, max_seq_len=512, buckets=(256,)
    )
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    prompts = [
        render_chat(
            runner.tokenizer, [{"role": "user", "content": f"Describe {TOPICS[i % 8]} number {i} as JSON."}]
        )
        for i in range(args.requests)
    ]
    constrained = [
        Request(id=f"c{i}", input_ids=tuple(ids), max_new_tokens=200, response_format=fmt)
        for i, ids in enumerate(prompts)
    ]
    grammars = NativeCore(runner, batching).grammars
    burst(runner, batching, grammars, constrained[:2])  # compiles the schema and llguidance's tokenizer once
    # the lengths the unconstrained twins are held to (greedy: every constrained burst reaches them)
    lengths = [len(tokens) for tokens in burst(runner, batching, grammars, constrained)[0]]
    twins = [
        Request(id=f"u{i}", input_ids=tuple(ids), max_new_tokens=length, ignore_eos=True)
        for i, (ids, length) in enumerate(zip(prompts, lengths))
    ]
    masks = runner.grammar_masks
    rounds = []
    for n in range(args.rounds):
        sides = {"constrained": (constrained, True), "twins": (twins, True), "every": (constrained, False)}
        order = list(sides)[n % 3 :] + list(sides)[: n % 3]  # each side first in turn: none always fresh
        served: dict[str, tuple[list[list[int]], float]] = {}
        for side in order:
            requests, masks.check_first = sides[side]
            if side == "constrained":
                masks.cpu_s.clear()
                masks.wait_s.clear()
                masks.masked.clear()
            served[side] = burst(runner, batching, grammars, requests)
            if side == "constrained":
                cpu_us = [s * 1e6 for s in masks.cpu_s]
                wait_us = [s * 1e6 for s in masks.wait_s]
                full_share = statistics.fmean(masks.masked)
        masks.check_first = True
        (outputs, constrained_s), (twin_outputs, plain_s) = served["constrained"], served["twins"]
        every_outputs, every_s = served["every"]
        assert [len(tokens) for tokens in outputs] == lengths
        assert [len(tokens) for tokens in twin_outputs] == lengths
        assert every_outputs == outputs  # the simpler policy serves the same tokens
        step_us, mask_us = replay_masks(runner, grammars, constrained, outputs)
        tokens = sum(lengths)
        row = {
            "round": n,
            "tokens": tokens,
            "constrained_tok_s": round(tokens / constrained_s, 1),
            "unconstrained_tok_s": round(tokens / plain_s, 1),
            "ratio": round(plain_s / constrained_s, 3),
            "ratio_every_row_masked_first": round(plain_s / every_s, 3),
            **percentiles("grammar_cpu_us_per_seq_per_step", cpu_us, 50, 99),
            "grammar_cpu_us_per_seq_per_step_mean": round(statistics.fmean(cpu_us), 1),
            "full_mask_share": round(full_share, 3),
            **percentiles("grammar_wait_us_per_step", wait_us, 50, 99),
            **percentiles("replay_every_row_masked_us_per_seq_per_step", step_us, 50, 99),
            **percentiles("replay_one_mask_us", mask_us, 50, 99),
            "replay_one_mask_us_mean": round(statistics.fmean(mask_us), 1),
        }
        rounds.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "bench": "structured",
        "host": host_kind(),
        "model": model,
        "dtype": args.dtype,
        "requests": args.requests,
        "commit": code_commit(),
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
        "ratio_every_row_masked_first_median": statistics.median(
            r["ratio_every_row_masked_first"] for r in rounds
        ),
        **{
            f"{key}_median": statistics.median(r[key] for r in rounds)
            for key in rounds[0]
            if key.startswith(("grammar_", "full_", "replay_"))
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
