"""The callers and processes of the Redis-loss drills (bench/redis_loss.py): a gateway process,
each kind of caller with its outcome, and the summary of outcomes against the bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

KINDS = ("sync", "async", "gateway", "gateway-stream")
Outcome = tuple[str, str, float]  # caller kind, outcome, monotonic time of the outcome


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def running(admin: Any, prefix: str) -> int:
    from tokenfleet.protocol import Keys
    from tokenfleet.transport.registry import heartbeats

    try:
        return sum(int(b.get("running", 0)) for b in heartbeats(admin, Keys(prefix)) if b["alive"])
    except Exception:  # Redis is down or empty mid-drill
        return 0


class Gateway:
    """``tokenfleet serve`` in a process of its own."""

    def __init__(self, url: str, prefix: str, model_dir: str):
        import httpx

        from tokenfleet.transport.server.embedded import free_port

        self.base = f"http://127.0.0.1:{free_port()}"
        port = self.base.rsplit(":", 1)[1]
        env = {**os.environ, "REDIS_URL": url, "TOKENFLEET_PREFIX": prefix}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", "serve", "--port", port, "--model", model_dir],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(os.environ.get("BENCH_GATEWAY_LOG", os.devnull), "a"),  # noqa: SIM115
        )

        def up() -> bool:
            try:
                return httpx.get(self.base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "the gateway")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def gateway_call(api: Any, prompt: str, new: int, stream: bool) -> str:
    """One completion, counted by its logprobs tokens (what the caller actually received)."""
    import openai

    ask = dict(
        model=api.tokenfleet_model, prompt=prompt, max_tokens=new, logprobs=1, extra_body={"min_tokens": new}
    )
    try:
        if stream:
            tokens = 0
            for chunk in api.completions.create(**ask, stream=True):
                for choice in chunk.choices:
                    tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
        else:
            choice = api.completions.create(**ask).choices[0]
            tokens = len(choice.logprobs.tokens)
    except openai.APITimeoutError:  # first: it is an APIError too
        return "hang"
    except openai.APIStatusError as e:
        return str((e.body or {}).get("code") or e.status_code) if isinstance(e.body, dict) else str(e)
    except openai.APIError as e:  # an error event mid-stream
        return "lost" if "lost" in str(e.body or e) else f"error: {e}"
    return "whole" if tokens == new else "short"


def client_outcome(get: Callable[[], Any], new: int) -> str:
    from tokenfleet.errors import RequestFailed, ResultTimeout

    try:
        result = get()
    except RequestFailed as e:
        return e.code
    except ResultTimeout:
        return "hang"
    return "whole" if len(result.token_ids) == new else "short"


def start_callers(
    url: str, prefix: str, model_dir: str, api: Any, per_kind: int, new: int, tag: str, timeout: float
):
    """``per_kind`` requests from each caller kind; returns futures of :data:`Outcome`."""
    from tokenfleet.producer import AsyncClient, Client

    pool = concurrent.futures.ThreadPoolExecutor(4 * per_kind)
    client = Client(url, model=model_dir, prefix=prefix)
    futures = []
    for i in range(per_kind):
        handle = client.submit(f"{tag} sync {i}", max_new_tokens=new, ignore_eos=True)
        futures.append(
            pool.submit(
                lambda h=handle: (
                    "sync",
                    client_outcome(lambda: h.result(timeout=timeout), new),
                    time.monotonic(),
                )
            )
        )

    async def follow() -> list[Outcome]:
        aclient = AsyncClient(url, model=model_dir, prefix=prefix)
        handles = [
            await aclient.submit(f"{tag} async {i}", max_new_tokens=new, ignore_eos=True)
            for i in range(per_kind)
        ]
        submitted.set()

        async def one(h: Any) -> Outcome:
            try:
                got = await h.result(timeout=timeout)
                outcome = "whole" if len(got.token_ids) == new else "short"
            except Exception as e:  # RequestFailed or a timeout
                outcome = getattr(e, "code", "hang")
            return "async", outcome, time.monotonic()

        try:
            return list(await asyncio.gather(*(one(h) for h in handles)))
        finally:
            await aclient.close()

    submitted = threading.Event()
    async_results = pool.submit(asyncio.run, follow())
    submitted.wait(60)
    for i in range(per_kind):
        for kind, stream in (("gateway", False), ("gateway-stream", True)):
            prompt = f"{tag} {kind} {i}"
            futures.append(
                pool.submit(
                    lambda p=prompt, k=kind, s=stream: (k, gateway_call(api, p, new, s), time.monotonic())
                )
            )
    return futures, async_results, pool, client


def openai_api(gateway: Gateway, timeout: float) -> Any:
    import openai

    api = openai.OpenAI(base_url=gateway.base + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    api.tokenfleet_model = api.models.list().data[0].id  # type: ignore[attr-defined]
    return api


def summarize(outcomes: list[Outcome], since: float, bound_s: float) -> dict[str, Any]:
    by_kind = {kind: dict(Counter(o for k, o, _ in outcomes if k == kind)) for kind in KINDS}
    seconds = [t - since for _, _, t in outcomes]
    errors = [t - since for _, o, t in outcomes if o != "whole"]
    return {
        "outcomes": {k: v for k, v in by_kind.items() if v},
        "bad": sum(o in ("short", "hang") for _, o, _ in outcomes),
        "seconds_to_last_outcome": round(max(seconds), 1),
        # a whole answer takes as long as its generation; an ended one must come within the bound
        "seconds_to_last_error": round(max(errors), 1) if errors else None,
        "bound_s": bound_s,
        "within_bound": max(errors, default=0.0) <= bound_s,
    }


def served_after(url: str, prefix: str, model_dir: str, api: Any) -> bool:
    from tokenfleet.producer import Client

    with Client(url, model=model_dir, prefix=prefix) as client:
        ok = len(client.submit("after", max_new_tokens=8, ignore_eos=True).result(timeout=120).token_ids) == 8
    return ok and gateway_call(api, "after", 8, stream=True) == "whole"
