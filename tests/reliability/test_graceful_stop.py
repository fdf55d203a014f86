"""A graceful stop: on SIGTERM a worker takes no new work, finishes the requests it holds (each
with ``model.generate``'s tokens), leaves what it had not read for other workers and exits 0."""

import signal
import subprocess
import time

from conftest import worker_process

from tokenfleet.producer import Client
from tokenfleet.protocol import Keys


def test_sigterm_finishes_what_is_held_and_leaves_the_rest(redis_url, prefix, r, tiny_model, reference):
    keys = Keys(prefix)
    worker = worker_process(
        tiny_model,
        redis_url,
        prefix,
        "--buckets",
        "16",
        "--max-wait-ms",
        "20",
        "--max-batch-size",
        "4",
        "--max-seq-len",
        "512",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=[16])
        held = [client.submit(f"held {i}", max_new_tokens=150, ignore_eos=True) for i in range(4)]
        next(iter(held[0].stream(timeout=120)))
        worker.send_signal(signal.SIGTERM)
        seen = []  # the worker's log up to the line saying its loop took the stop in: no read after it
        for line in worker.stdout:
            seen.append(line)
            if "stopping: taking no new work" in line:
                break
        later = [client.submit(f"later {i}", max_new_tokens=5) for i in range(2)]
        rest, _ = worker.communicate(timeout=120)
        logs = "".join(seen) + rest
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, logs[-2000:]
    for i, h in enumerate(held):
        res = h.result(timeout=5)
        assert res.finish_reason == "length"
        assert res.token_ids == reference.greedy(reference.ids(f"held {i}"), 150, ignore_eos=True)
    from tokenfleet.transport.status import queue_totals

    queue = queue_totals(r, keys.queue_streams(16), time.time())
    assert queue["pending"] == 0 and queue["depth"] == len(later)  # left for other workers, unread
