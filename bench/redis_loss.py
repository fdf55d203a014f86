"""Redis losing its data under load, as a drill (issue 49's acceptance at full scale): a private
``redis-server``, one worker process and a gateway process, every kind of caller at once. Never
run as a test (tests/reliability holds the small versions); prints one JSON line per drill.

- ``restart``: ``--running`` requests generating and ``--queued`` waiting, split evenly between
  the sync client, the asyncio client, the gateway whole and the gateway streamed; Redis is killed
  (-9) and restarted empty. Each caller's outcome (``whole``: every token, ``lost``, another error
  code, ``short``: fewer tokens reported as complete, ``hang``: nothing by its timeout) and the
  seconds from the restart to it; then a new request through the client and the gateway.
- ``full``: ``--streaming`` requests stream while Redis's ``maxmemory`` is set to half what it uses;
  submits meanwhile get ``redis_full``; after ``--full-s`` the limit is lifted and every accepted
  request must end ``done`` (whole) or with an error.
- ``batch``: ``tokenfleet batch`` of ``--lines`` lines, Redis killed and restarted empty while it
  runs: every line must come back answered.

    python -m bench.redis_loss                       # all three, the tiny model
    python -m bench.redis_loss --drills restart --running 100 --queued 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from bench.common import code_commit, host_kind, model_or_built, worker_process
from bench.loss_callers import (
    Gateway,
    Outcome,
    openai_api,
    running,
    served_after,
    start_callers,
    summarize,
    wait_for,
)


def restart_drill(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import redis

    from tokenfleet.transport.server.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    prefix = f"drill-restart-{os.getpid()}"
    flags = [
        "--max-batch-size",
        str(args.running),
        "--max-wait-ms",
        "10",
        "--claim-idle-ms",
        str(args.claim_idle_ms),
    ]
    timeout = 3 * args.claim_idle_ms / 1000 + 60
    try:
        with worker_process(server.url, prefix, model_dir, flags):
            gateway = Gateway(server.url, prefix, model_dir)
            api = openai_api(gateway, timeout)
            admin = redis.Redis.from_url(server.url)
            first = start_callers(
                server.url, prefix, model_dir, api, args.running // 4, args.new, "run", timeout
            )
            wait_for(lambda: running(admin, prefix) >= args.running, 120, f"{args.running} requests running")
            second = start_callers(
                server.url, prefix, model_dir, api, args.queued // 4, args.new, "queued", timeout
            )
            time.sleep(2.0)  # the gateway's have been enqueued
            killed = time.monotonic()
            server.proc.kill()  # type: ignore[union-attr]
            server.proc.wait()  # type: ignore[union-attr]
            time.sleep(1.0)
            server.start()  # empty: no AOF, no RDB
            outcomes: list[Outcome] = []
            for futures, async_results, pool, client in (first, second):
                outcomes += [f.result() for f in futures] + async_results.result()
                pool.shutdown()
                client.close()
            result = {"drill": "restart", "running": args.running, "queued": args.queued}
            result.update(summarize(outcomes, killed, 2 * args.claim_idle_ms / 1000))
            result["served_after"] = served_after(server.url, prefix, model_dir, api)
            gateway.close()
            return result
    finally:
        server.stop()


def refused_while_full(url: str, prefix: str, model_dir: str, api: Any) -> dict[str, str]:
    """What a producer gets from a full Redis: the client's error and the gateway's code."""
    import openai

    from tokenfleet.producer import Client

    got = {}
    with Client(url, model=model_dir, prefix=prefix) as client:
        try:
            client.submit("refused", max_new_tokens=4)
            got["client"] = "accepted"
        except Exception as e:
            got["client"] = f"{type(e).__name__}: {e}"
    try:
        api.with_options(timeout=30).completions.create(
            model=api.tokenfleet_model, prompt="refused", max_tokens=4
        )
        got["gateway"] = "accepted"
    except openai.APITimeoutError:
        got["gateway"] = "hang"
    except openai.APIStatusError as e:
        got["gateway"] = (
            f"{e.status_code} {(e.body or {}).get('code') if isinstance(e.body, dict) else e.body}"
        )
    return got


@contextlib.contextmanager
def room_after(admin: Any) -> Iterator[None]:
    """Lift ``maxmemory`` on the way out, whatever failed: the worker's SIGTERM needs room."""
    try:
        yield
    finally:
        admin.config_set("maxmemory", 0)


def full_drill(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import redis

    from tokenfleet.transport.server.embedded import EmbeddedRedis
    from tokenfleet.transport.status import redis_memory

    server = EmbeddedRedis().start()
    prefix = f"drill-full-{os.getpid()}"
    flags = ["--max-batch-size", str(args.streaming), "--max-wait-ms", "10"]
    timeout = args.full_s + 300
    admin = redis.Redis.from_url(server.url)
    try:
        with worker_process(server.url, prefix, model_dir, flags) as worker, room_after(admin):
            gateway = Gateway(server.url, prefix, model_dir)
            api = openai_api(gateway, timeout)
            futures, async_results, pool, client = start_callers(
                server.url, prefix, model_dir, api, args.streaming // 4, args.new, "full", timeout
            )
            wait_for(
                lambda: running(admin, prefix) >= args.streaming, 120, f"{args.streaming} requests running"
            )
            # half what it uses: full for the whole --full-s, whatever Redis frees meanwhile
            admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) // 2)
            full_at = time.monotonic()
            time.sleep(1.0)
            refused = refused_while_full(server.url, prefix, model_dir, api)
            time.sleep(max(0.0, args.full_s - (time.monotonic() - full_at)))
            worker_alive = worker.poll() is None
            status_says_full = redis_memory(admin)["out_of_memory"]
            admin.config_set("maxmemory", 0)
            room_at = time.monotonic()
            outcomes = [f.result() for f in futures] + async_results.result()
            pool.shutdown()
            client.close()
            result = {"drill": "full", "streaming": args.streaming, "full_s": args.full_s, "refused": refused}
            result.update(summarize(outcomes, full_at, timeout))
            result["ended_whole_or_error"] = all(o not in ("short", "hang") for _, o, _ in outcomes)
            result["seconds_from_room_to_last_outcome"] = round(max(t for *_, t in outcomes) - room_at, 1)
            result["worker_alive_while_full"] = worker_alive
            result["status_says_out_of_memory"] = status_says_full
            result["served_after"] = served_after(server.url, prefix, model_dir, api)
            gateway.close()
            return result
    finally:
        server.stop()


def rows_of(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def batch_drill(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    prefix = f"drill-batch-{os.getpid()}"
    flags = ["--max-batch-size", "32", "--max-wait-ms", "10"]
    with tempfile.TemporaryDirectory() as tmp, worker_process(server.url, prefix, model_dir, flags):
        lines, output = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
        with open(lines, "w") as f:
            for i in range(args.lines):
                f.write(
                    json.dumps({"prompt": f"batch line {i}", "max_new_tokens": args.new, "ignore_eos": True})
                    + "\n"
                )
        env = {**os.environ, "REDIS_URL": server.url, "TOKENFLEET_PREFIX": prefix}
        command = [sys.executable, "-m", "tokenfleet", "batch", lines, "-o", output, "--model", model_dir]
        job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def a_third() -> bool:
            if job.poll() is not None:
                raise SystemExit(f"tokenfleet batch exited early (rc {job.returncode})")
            return len(rows_of(output)) >= args.lines // 3

        wait_for(a_third, 600, "a third of the lines")
        answered_at_kill = len(rows_of(output))
        server.proc.kill()  # type: ignore[union-attr]
        server.proc.wait()  # type: ignore[union-attr]
        time.sleep(1.0)
        server.start()
        rc = job.wait(900)
        rows = rows_of(output)
        server.stop()
    whole = sum(len(r.get("token_ids") or []) == args.new for r in rows)
    return {
        "drill": "batch",
        "lines": args.lines,
        "rc": rc,
        "rows": len(rows),
        "answered_at_kill": answered_at_kill,
        "in_order": [r["index"] for r in rows] == list(range(len(rows))),
        "answered_whole": whole,
        "errors": dict(Counter(r["error"]["code"] for r in rows if "error" in r)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model dir (default: build the tiny model in a temp dir)")
    p.add_argument("--drills", default="restart,full,batch")
    p.add_argument("--running", type=int, default=100, help="restart: requests generating at the kill")
    p.add_argument("--queued", type=int, default=100, help="restart: requests waiting at the kill")
    p.add_argument("--streaming", type=int, default=200, help="full: requests streaming as Redis fills")
    p.add_argument("--full-s", type=float, default=10.0, help="full: seconds Redis stays full")
    p.add_argument("--lines", type=int, default=300, help="batch: lines of the batch job")
    p.add_argument("--new", type=int, default=256, help="tokens per request (ignore_eos)")
    p.add_argument("--claim-idle-ms", type=int, default=30_000, help="restart: the workers' setting")
    args = p.parse_args(argv)
    model_dir = model_or_built(args.model)
    drills = {"restart": restart_drill, "full": full_drill, "batch": batch_drill}
    for name in args.drills.split(","):
        result = drills[name](args, model_dir)
        print(json.dumps({**result, "host": host_kind(), "commit": code_commit()}), flush=True)


if __name__ == "__main__":
    main()
