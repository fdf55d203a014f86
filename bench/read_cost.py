"""What a worker's per-turn read of its request streams costs Redis, with affinity shards and
without: the read script run ``--reads`` times over empty streams (the common case between
arrivals), as Redis's own ``commandstats`` counts it (microseconds of Redis time per call) and as
the caller waits (round trip). Rows: ``before-shards`` (one stream per bucket and lane),
``no-affinity`` (every shard read as one's own: ``--steal-after-ms 0``), ``affinity-2-workers``
(own shards first, the others' looked at every 50 ms). Never run as a test.

    python -m bench.read_cost                      # REDIS_URL or 127.0.0.1:6379, own prefix
"""

from __future__ import annotations

import argparse
import json
import os
import time

import redis

from bench.common import code_commit, host_kind
from tokenfleet.protocol import LANES, Keys
from tokenfleet.transport.intake import StreamReader
from tokenfleet.transport.shards import assign


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", default="128,512,2048,8192")
    p.add_argument("--reads", type=int, default=500)
    args = p.parse_args()
    r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    keys = Keys(f"read-cost-{os.getpid()}")
    buckets = [int(b) for b in args.buckets.split(",")]
    reader = StreamReader(r, keys.lane_streams(buckets), "me", 500)
    reader.ensure_groups()
    beats = [{"name": n, "alive": True, "buckets": buckets} for n in ("me", "other")]
    affinity = assign(keys, "me", buckets, beats)
    rows = {
        "before-shards": (
            [[*(keys.request_stream(b, lane) for b in buckets), keys.auto_stream_of(lane)] for lane in LANES],
            [[] for _ in LANES],
        ),
        "no-affinity": (keys.lane_streams(buckets), [[] for _ in LANES]),
        "affinity-2-workers": (affinity.own, affinity.others),
    }
    try:
        for name, (own, others) in rows.items():
            reader.assign(own, others)
            r.config_resetstat()
            began = time.perf_counter()
            for _ in range(args.reads):
                reader.read((8, 8), None)
            wall = (time.perf_counter() - began) / args.reads
            stats = r.info("commandstats").get("cmdstat_evalsha", {})
            row = {
                "row": name,
                "redis_us_per_read": stats.get("usec_per_call"),
                "round_trip_us": round(wall * 1e6),
            }
            print(json.dumps({**row, "host": host_kind(), "commit": code_commit()}), flush=True)
    finally:
        r.delete(*reader.streams)


if __name__ == "__main__":
    main()
