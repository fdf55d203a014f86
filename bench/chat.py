"""The shared-prefix chat workload, side by side: what chat apps send. ``--requests`` chats share one
system prompt; each turn sends every chat's whole history (system prompt, earlier user messages
and the system's own earlier answers) plus a new user message, all chats at once, and waits for
every answer before the next turn. Greedy, EOS ignored, random token ids.

Rows, taking turns round by round: ``tokenfleet-defaults-threads`` (a worker on the README's flags:
``--dtype`` only, so prefix caching on; the sync client from a thread per request),
``tokenfleet-defaults-threads-no-prefix-caching`` (the same worker with ``--no-prefix-caching``)
and ``vllm-best`` (vLLM-CPU's offline engine, its prefix caching on as by default, tcmalloc and its
libiomp5 preloaded). Reported per row: tokens/s over all turns, and TTFT p50 per turn; ``vs
vLLM`` is the median of the within-round ratios. Never run as a test.

    python -m bench.chat --model DIR --dtype bfloat16 --rounds 3
    python -m bench.compare --model DIR --workload chat --rounds 3      (the same)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import code_commit, host_kind, model_or_built, percentile, worker_process

ROWS = ("tokenfleet-defaults-threads", "tokenfleet-defaults-threads-no-prefix-caching", "vllm-best")


@dataclass(frozen=True)
class Chat:
    """The workload: one system prompt, and each chat's user message at each turn."""

    system: list[int]
    users: list[list[list[int]]]  # users[turn][chat]
    new_tokens: int

    @property
    def chats(self) -> int:
        return len(self.users[0])

    def prompt(self, turn: int, chat: int, answers: list[list[list[int]]]) -> list[int]:
        """Chat ``chat``'s prompt at ``turn``: its whole history, then its new message."""
        ids = list(self.system)
        for earlier in range(turn):
            ids += self.users[earlier][chat] + answers[earlier][chat]
        return ids + self.users[turn][chat]


def make_chat(chats: int, system_len: int, user_len: int, turns: int, new_tokens: int, seed: int) -> Chat:
    from tokenfleet.models import VOCAB_SIZE

    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE - 64) for _ in range(n)]  # no specials, no padding ids

    users = [
        [tokens(rng.randint(user_len // 2, user_len * 3 // 2)) for _ in range(chats)] for _ in range(turns)
    ]
    return Chat(tokens(system_len), users, new_tokens)


def turn_stats(name: str, waves: list[dict], note: str) -> dict:
    """A row from its turns: each a dict of ``wall_s``, ``ttft_ms`` (per chat), ``token_ids``."""
    generated = sum(len(ids) for wave in waves for ids in wave["token_ids"])
    wall = sum(wave["wall_s"] for wave in waves)
    return {
        "system": name,
        "chats": len(waves[0]["token_ids"]),
        "turns": len(waves),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "turn_wall_s": [round(wave["wall_s"], 2) for wave in waves],
        "ttft_p50_ms": [round(percentile(wave["ttft_ms"], 50) or 0.0, 1) for wave in waves],
        "ttft_p99_ms": [round(percentile(wave["ttft_ms"], 99) or 0.0, 1) for wave in waves],
        "note": note,
    }


# -- tokenfleet: a worker on the README's flags, a sync client from a thread per request -----------


def run_tokenfleet(model_dir: str, dtype: str, chat: Chat, prefix_caching: bool) -> dict:
    from bench.defaults_e2e import warm_pool
    from tokenfleet.producer import Client
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    flags = ["--dtype", dtype] + ([] if prefix_caching else ["--no-prefix-caching"])
    prefix = f"chat-{os.getpid()}"
    waves: list[dict] = []
    answers: list[list[list[int]]] = []
    with (
        EmbeddedRedis() as server,
        worker_process(server.url, prefix, model_dir, flags),
        Client(server.url, model=model_dir, prefix=prefix) as client,
    ):
        client.submit(input_ids=[3, 4, 5], max_new_tokens=2, ignore_eos=True).result(timeout=300)
        warm_pool(client, chat.chats)
        for turn in range(len(chat.users)):
            prompts = [chat.prompt(turn, i, answers) for i in range(chat.chats)]
            waves.append(wave_through_threads(client, prompts, chat.new_tokens))
            answers.append(waves[-1]["token_ids"])
    name = "tokenfleet-defaults-threads" + ("" if prefix_caching else "-no-prefix-caching")
    return turn_stats(name, waves, f"worker flags: {' '.join(flags)} (the README's)")


def wave_through_threads(
    client, prompts: list[list[int]], new_tokens: int, cache_keys: list[str] | None = None
) -> dict:
    """Every prompt submitted at once, each from its own thread, streamed token by token (with
    ``cache_keys``: each request's affinity key)."""
    ids: list[list[int]] = [[] for _ in prompts]
    ttft = [0.0] * len(prompts)
    ends = [0.0] * len(prompts)
    start = time.perf_counter() + 0.2  # every thread started before the first submission

    def one(i: int) -> None:
        time.sleep(max(0.0, start - time.perf_counter()))
        key = {"cache_key": cache_keys[i]} if cache_keys else {}
        handle = client.submit(input_ids=prompts[i], max_new_tokens=new_tokens, ignore_eos=True, **key)
        for chunk in handle.stream(timeout=900):
            if not ids[i]:
                ttft[i] = (time.perf_counter() - start) * 1000
            ids[i].extend(chunk.token_ids)
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"wall_s": max(ends) - start, "ttft_ms": ttft, "token_ids": ids}


# -- vLLM-CPU: its offline engine in its own virtualenv ---------------------------------------------


def run_vllm(model_dir: str, dtype: str, chat: Chat, max_batch_size: int, max_seq_len: int) -> dict:
    from bench.rows_vllm import HERE, VLLM_VENV, vllm_best_env

    spec = {
        "model": model_dir,
        "dtype": dtype,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "chat": {"system": chat.system, "users": chat.users, "new_tokens": chat.new_tokens},
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        done = subprocess.run(
            [str(VLLM_VENV / "bin" / "python"), str(HERE / "peers" / "vllm_offline.py"), str(out)],
            input=json.dumps(spec),
            text=True,
            capture_output=True,
            env={**os.environ, **vllm_best_env()},
            timeout=3600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"vLLM failed: {done.stderr[-2000:]}")
        waves = json.loads(out.read_text())["turns"]
    return turn_stats("vllm-best", waves, "offline LLMEngine (prefix caching on), tcmalloc+libiomp5 preload")


# -- rounds -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="tiny")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=32, help="chats")
    p.add_argument("--system-len", type=int, default=700, help="tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, default=40, help="mean tokens of a user message")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32, help="vLLM's max_num_seqs")
    p.add_argument("--only", help=f"comma-separated rows among {','.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results")
    args, _ = p.parse_known_args(argv)

    model_dir = model_or_built(args.model, args.size)
    chat = make_chat(args.requests, args.system_len, args.user_len, args.turns, args.new_tokens, args.seed)
    longest = max(
        len(chat.prompt(args.turns - 1, i, [[[0] * args.new_tokens] * chat.chats] * args.turns))
        for i in range(chat.chats)
    )
    max_seq_len = 1 << (longest + args.new_tokens - 1).bit_length()
    runners = {
        "tokenfleet-defaults-threads": lambda: run_tokenfleet(model_dir, args.dtype, chat, True),
        "tokenfleet-defaults-threads-no-prefix-caching": lambda: run_tokenfleet(
            model_dir, args.dtype, chat, False
        ),
        "vllm-best": lambda: run_vllm(model_dir, args.dtype, chat, args.max_batch_size, max_seq_len),
    }
    rows = args.only.split(",") if args.only else list(ROWS)
    by_round: list[dict[str, dict]] = []
    for round_no in range(args.rounds):
        done = {}
        for name in rows:
            print(f"running {name} (round {round_no + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
            try:
                done[name] = runners[name]()
            except Exception as e:  # one failing peer must not cost the others' figures
                print(f"{name} failed: {e}", file=sys.stderr)
                continue
            print(json.dumps(done[name]), flush=True)
        by_round.append(done)
    summary = summarize_rounds(rows, by_round)
    meta = {
        "host": host_kind(),
        "commit": code_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.chat " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": model_dir,
        "dtype": args.dtype,
        "workload": "chat",
        "chats": args.requests,
        "system_len": args.system_len,
        "turns": args.turns,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"chat-{Path(model_dir).name}-{args.dtype}.json"
    path.write_text(json.dumps({"meta": meta, "rows": summary, "rounds": by_round}, indent=1))
    print(json.dumps({"meta": meta, "rows": summary}))
    print(f"written: {path}", file=sys.stderr)


def summarize_rounds(rows: list[str], by_round: list[dict[str, dict]]) -> list[dict]:
    """Each row's median round (by tokens/s), with its ratio to vLLM's taken within each round."""
    summary = []
    for name in rows:
        runs = [r[name] for r in by_round if name in r]
        if not runs:
            continue
        median = sorted(runs, key=lambda row: row["tokens_per_s"])[(len(runs) - 1) // 2]
        ratios = [
            r[name]["tokens_per_s"] / r["vllm-best"]["tokens_per_s"]
            for r in by_round
            if name in r and "vllm-best" in r
        ]
        summary.append(
            {
                **median,
                "rounds_tokens_per_s": [run["tokens_per_s"] for run in runs],
                "vs_vllm_best": round(statistics.median(ratios), 3) if ratios else None,
                "rounds_vs_vllm": [round(x, 3) for x in ratios],
            }
        )
    return summary


if __name__ == "__main__":
    main()
