"""Decode attention alone: ``tokenfleet::paged_decode`` over a whole model's layers against the
time a plain read of the same K/V bytes takes (the memory floor), rounds taking turns.

    python -m bench.decode_attention                       # SmolLM2's heads: 9 query, 3 KV, 64 wide
    python -m bench.decode_attention --heads 28 --kv-heads 4 --head-dim 128 --layers 28 --context 512

One decode step for ``--batch`` sequences of ``--context`` tokens each, through ``--layers``
layers of pool (more than the caches hold, so the K/V come from memory as in a real step), with
the blocks of each sequence in order or shuffled through the pool (a long-running worker's
blocks lie anywhere). Prints one JSON line per dtype and block order: milliseconds per step, the
GB/s of K/V read, and ``of_floor``: the read's time over the kernel's (1.0: as fast as memory
allows). Never run as a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import host_kind
from tokenfleet.engines.native.kernels.loader import load_kernels

BLOCK = 16


def pools(args: argparse.Namespace, dtype: torch.dtype, shuffled: bool) -> tuple[list, torch.Tensor]:
    per_seq = -(-args.context // BLOCK)
    blocks = args.batch * per_seq
    layers = [
        tuple(torch.randn(blocks + 1, BLOCK, args.kv_heads, args.head_dim).to(dtype) for _ in range(2))
        for _ in range(args.layers)
    ]
    order = torch.randperm(blocks) if shuffled else torch.arange(blocks)
    return layers, order.view(args.batch, per_seq)


def step_seconds(args: argparse.Namespace, dtype: torch.dtype, shuffled: bool) -> dict:
    layers, tables = pools(args, dtype, shuffled)
    batch, heads, kv_heads, dim = args.batch, args.heads, args.kv_heads, args.head_dim
    query = torch.randn(batch, heads, 1, dim).to(dtype)
    new = torch.randn(batch, kv_heads, 1, dim).to(dtype)
    lengths = torch.full((batch,), args.context)
    write_blocks = tables[:, (args.context - 1) // BLOCK].clone()
    write_offsets = torch.full((batch,), (args.context - 1) % BLOCK)
    decode = torch.ops.tokenfleet.paged_decode

    def kernel() -> None:
        for k, v in layers:
            decode(query, new, new, k, v, write_blocks, write_offsets, tables, lengths, dim**-0.5)

    def floor() -> None:  # the same bytes, read once in order
        for k, v in layers:
            k.sum(), v.sum()

    kernel()
    floor()
    times: dict[str, list[float]] = {"kernel": [], "floor": []}
    for _ in range(args.rounds):
        for name, run in (("kernel", kernel), ("floor", floor)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    kernel_s, floor_s = statistics.median(times["kernel"]), statistics.median(times["floor"])
    nbytes = 2 * args.layers * batch * args.context * kv_heads * dim * dtype.itemsize
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "blocks": "shuffled" if shuffled else "in order",
        "ms_per_step": round(kernel_s * 1e3, 2),
        "kv_gb_per_s": round(nbytes / kernel_s / 1e9, 1),
        "of_floor": round(floor_s / kernel_s, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=176, help="tokens per sequence (the fixed workload's mean)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    if load_kernels() is None:
        raise SystemExit("the CPU kernels could not be built here (see the worker's log line)")
    host = host_kind()
    for name in args.dtypes.split(","):
        for shuffled in (False, True):
            figures = step_seconds(args, getattr(torch, name), shuffled)
            print(json.dumps({"host": host, **figures}), flush=True)


if __name__ == "__main__":
    main()
