"""The dashboard's cost: how fast its data loads on a big fleet, and what an open page costs the
fleet's throughput.

    python -m bench.dashboard                       # both parts, tiny model, 6 rounds
    python -m bench.dashboard --part load --rounds 30
    python -m bench.dashboard --part throughput --model ./smollm2 --rounds 8

``load``: 100 synthetic workers' heartbeats, 10,000 queued entries over every bucket, lane and
shard stream, an hour of time series and 500 dead letters under a prefix of its own; a
``tokenfleet dashboard`` process serves them. Timed: each API call the page makes (over HTTP,
``--rounds`` times, p50/p95/max), and in headless Chromium (where installed) the page's own
timings from the navigation's start to the overview's data in and to the page drawn with it (a
fresh browser's first page, which also starts its renderer, apart).

``throughput``: one ``tokenfleet worker`` (the README's flags) serves a fixed workload (64 requests,
``--new-tokens`` each, all at once, from the asyncio client) in rounds that take turns: no page, the
page's polling alone (its API calls every 2 s, as from a laptop elsewhere), and a headless
Chromium page on this machine (browser and fleet share its CPUs: the worst case). Each round's
tokens/s over the no-page round of the same pass; the medians are the figures.

Prints one JSON object; never run as a test.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.common import host_kind, model_or_built, percentile, worker_process
from tokenfleet import protocol
from tokenfleet.protocol import GROUP, LANES, Keys
from tokenfleet.protocol.affinity import SHARDS
from tokenfleet.transport.server.embedded import free_port

KEY = "bench-admin-key"
BUCKETS = (128, 512, 2048, 4096)


def fill_fleet(client: redis.Redis, keys: Keys, workers: int, entries: int, dead: int) -> None:
    """A big fleet as Redis holds it: heartbeats, queued entries, an hour of series, dead letters."""
    now = time.time()
    pipe = client.pipeline(transaction=False)
    pipe.sadd(keys.buckets, *BUCKETS)
    for k in range(workers):
        beat = {"buckets": list(BUCKETS), "engine": "native", "model": "smollm2", "device": "cpu"}
        beat |= {"running": 12, "waiting": 3, "kv_blocks_used": 700, "kv_blocks_total": 2048}
        beat |= {"finished": 1000 + k, "tokens_per_s": 412.5, "shards_owned": 2, "seen": now - k % 7}
        pipe.hset(keys.workers, f"worker-{k:03d}", protocol.pack(beat))
    streams = [s for lane in LANES for b in BUCKETS for s in keys.queue_streams(b, lane)]
    for stream in streams:
        pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
    body = {"v": protocol.PROTOCOL_VERSION, "prompt": "a prompt of a few words " * 8, "max_new_tokens": 64}
    for n in range(entries):
        pipe.xadd(streams[n % len(streams)], {"m": protocol.pack({**body, "id": f"q{n}"})})
    for slot in range(int(now // 10) - 360, int(now // 10)):
        fields = {
            "tokens": 4000,
            "started": 60,
            "finished": 60,
            "queue_s": 3.0,
            "ttft_s": 9.0,
            "ttft_le_3": 60,
        }
        pipe.hset(keys.series(slot), mapping=fields)
        pipe.expire(keys.series(slot), 3700)
    for n in range(dead):
        letter = {"stream": streams[0], "entry": f"1-{n}", "code": "too_many_attempts", "reason": "x" * 80}
        letter |= {
            "worker": "worker-000",
            "at": str(now),
            "body": protocol.pack({b"m": b"\x80"}),
            "body_bytes": "4",
        }
        pipe.xadd(keys.dead_letter, letter)
    pipe.execute()


def clean(client: redis.Redis, keys: Keys) -> None:
    for pattern in keys.patterns:
        names = list(client.scan_iter(match=pattern, count=1000))
        for k in range(0, len(names), 500):
            client.delete(*names[k : k + 500])


@contextmanager
def dashboard(url: str, prefix: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    command = [sys.executable, "-m", "tokenfleet", "dashboard", "--port", str(port), "--prefix", prefix]
    proc = subprocess.Popen(
        [*command, "--redis-url", url, "--admin-keys", KEY],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/dashboard", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield base, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def time_load(base: str, rounds: int, workers: int) -> dict[str, object]:
    calls = {"whoami": "/whoami", "overview": "/overview", "dead": "/dead", "jobs": "/jobs"}
    times: dict[str, list[float]] = {name: [] for name in calls}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base + "/dashboard/api", headers=auth, timeout=30) as http:
        http.get("/overview").raise_for_status()  # warm: the server's first call imports its modules
        for _ in range(rounds):
            for name, path in calls.items():
                started = time.perf_counter()
                http.get(path).raise_for_status()
                times[name].append((time.perf_counter() - started) * 1000)
    out: dict[str, object] = {
        name: {"p50_ms": _r(percentile(t, 50)), "p95_ms": _r(percentile(t, 95)), "max_ms": _r(max(t))}
        for name, t in times.items()
    }
    browser = chromium()
    if browser is not None:
        from playwright.sync_api import sync_playwright

        loaded, drawn = [], []
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(executable_path=browser, args=["--no-sandbox"])
            for n in range(max(3, rounds // 3) + 1):
                page = launched.new_page()
                page.goto(f"{base}/dashboard#key={KEY}")
                page.wait_for_selector(f"#workers tbody tr:nth-child({workers})")
                # from the navigation's start: the overview's data in, and the page drawn with it
                timing = page.evaluate(PAGE_TIMING)
                page.close()
                if n == 0:  # a fresh browser's first page also starts its renderer: told apart
                    out["browser_first_page_drawn_ms"] = _r(timing["drawn"])
                    continue
                loaded.append(timing["loaded"])
                drawn.append(timing["drawn"])
            launched.close()
        for name, values in (("browser_data_loaded", loaded), ("browser_page_drawn", drawn)):
            out[name] = {"p50_ms": _r(percentile(values, 50)), "max_ms": _r(max(values))}
    return out


PAGE_TIMING = """() => ({
  loaded: performance.getEntriesByType("resource").find((e) => e.name.includes("/api/overview")).responseEnd,
  drawn: performance.getEntriesByName("tokenfleet:overview-drawn")[0].startTime,
})"""


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _chromium_cpu_s() -> float:
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if b"chromium" in (entry / "cmdline").read_bytes():
                    total += _proc_cpu_s(int(entry.name))
    return total


def _redis_cpu_s(client: redis.Redis) -> float:
    info: Any = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def open_page_cpu(base: str, pid: int, client: redis.Redis, seconds: float = 30.0) -> dict[str, object]:
    """What an open page costs, as a share of one core: the dashboard's server and Redis (idle
    first, then the page's polling), and the browser itself where it runs on the same machine."""

    def measure(how: str) -> dict[str, float]:
        with page_open(base, how):
            time.sleep(3.0)  # the page up (a browser's start is not the open page's cost)
            before = (_proc_cpu_s(pid), _redis_cpu_s(client), _chromium_cpu_s())
            time.sleep(seconds)
            after = (_proc_cpu_s(pid), _redis_cpu_s(client), _chromium_cpu_s())
        names = ("dashboard_server", "redis", "browser")
        return {name: (a - b) / seconds * 100 for name, a, b in zip(names, after, before)}

    idle, polling = measure("none"), measure("polling")
    out: dict[str, object] = {
        "polling_pct_of_a_core": {k: round(polling[k] - idle[k], 2) for k in ("dashboard_server", "redis")},
    }
    if chromium():
        browser = measure("browser")
        out["browser_page_pct_of_a_core"] = {k: round(browser[k] - idle[k], 2) for k in browser}
    return out


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def _workload(url: str, prefix: str, model: str, requests: int, new_tokens: int) -> float:
    from tokenfleet.producer import AsyncClient

    client = AsyncClient(url, model=model, prefix=prefix)
    try:
        started = time.perf_counter()
        handles = [
            await client.submit(f"round prompt {k} " * 8, max_new_tokens=new_tokens, ignore_eos=True)
            for k in range(requests)
        ]
        results = await asyncio.gather(*(client.result(h.id, timeout=600) for h in handles))
        return sum(r.usage["completion_tokens"] for r in results) / (time.perf_counter() - started)
    finally:
        await client.close()


def _run_workload(url: str, prefix: str, model: str, requests: int, new_tokens: int) -> float:
    """:func:`_workload` on a thread of its own: Playwright's sync API keeps an event loop on this one."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _workload(url, prefix, model, requests, new_tokens)).result()


@contextmanager
def page_open(base: str, how: str) -> Iterator[None]:
    """``polling``: the page's API calls every 2 s from a thread; ``browser``: the page itself."""
    if how == "none":
        yield
        return
    stop = threading.Event()
    if how == "polling":

        def poll() -> None:
            with httpx.Client(
                base_url=base + "/dashboard/api", headers={"Authorization": f"Bearer {KEY}"}
            ) as h:
                while not stop.is_set():
                    h.get("/overview")
                    stop.wait(2.0)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        yield
        stop.set()
        thread.join()
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = launched.new_page()
        page.goto(f"{base}/dashboard#key={KEY}")
        page.wait_for_selector("#app:not([hidden])")
        yield
        launched.close()


def time_throughput(url: str, model: str, rounds: int, new_tokens: int) -> dict[str, object]:
    prefix = f"tfbench-dash-{secrets.token_hex(3)}"
    kinds = ["none", "polling", *(["browser"] if chromium() else [])]
    ratios: dict[str, list[float]] = {k: [] for k in kinds if k != "none"}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    with worker_process(url, prefix, model, []), dashboard(url, prefix) as (base, _):
        _run_workload(url, prefix, model, 16, 8)  # warm-up
        for n in range(rounds):
            order = kinds if n % 2 == 0 else kinds[::-1]  # rounds take turns
            for kind in order:
                with page_open(base, kind):
                    rates[kind].append(_run_workload(url, prefix, model, 64, new_tokens))
            for kind in ratios:
                ratios[kind].append(rates[kind][-1] / rates["none"][-1])
    clean(redis.Redis.from_url(url), Keys(prefix))
    return {
        "tokens_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "ratio_to_no_page_median": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
        "ratios": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
        "workload": f"{rounds} rounds of 64 requests x {new_tokens} new tokens",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("load", "throughput", "both"), default="both")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random model)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--new-tokens", type=int, default=256, help="per request, in the throughput part")
    args = parser.parse_args()
    out: dict[str, object] = {"host": host_kind(), "redis": args.redis_url}
    if args.part in ("load", "both"):
        client = redis.Redis.from_url(args.redis_url)
        keys = Keys(f"tfbench-dash-{secrets.token_hex(3)}")
        try:
            fill_fleet(client, keys, args.workers, args.entries, dead=500)
            with dashboard(args.redis_url, keys.prefix) as (base, pid):
                out["load"] = {"workers": args.workers, "entries": args.entries, "shards": SHARDS}
                out["load"] |= time_load(base, args.rounds, args.workers)  # type: ignore[operator]
                out["open_page_cpu"] = open_page_cpu(base, pid, client)
        finally:
            clean(client, keys)
    if args.part in ("throughput", "both"):
        model = model_or_built(args.model)
        out["throughput"] = time_throughput(args.redis_url, model, args.rounds, args.new_tokens)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
