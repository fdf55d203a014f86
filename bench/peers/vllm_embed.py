"""Embed a JSONL file of texts with vLLM's offline pooling runner; runs inside vLLM's own
virtualenv. Usage: ``vllm_embed.py MODEL TEXTS.jsonl VECTORS.npy RESULT.json``. Writes the
vectors (float32, input order) and ``{"wall_s": ...}`` (the embed call alone, the engine loaded).
Never imports tokenfleet: the two virtualenvs have different packages."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    import numpy as np
    from vllm import LLM

    model, source, vectors, result = sys.argv[1:5]
    texts = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    # the model's own length (sentence-transformers' max_seq_length); the default 0.92 of RAM for
    # its cache refuses to start where anything else runs
    llm = LLM(model=model, runner="pooling", dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)
    llm.embed(texts[:64])  # warm-up, as the other rows' workers are warm
    began = time.perf_counter()
    out = llm.embed(texts)
    wall = time.perf_counter() - began
    np.save(vectors, np.asarray([o.outputs.embedding for o in out], dtype=np.float32))
    with open(result, "w") as f:
        json.dump({"wall_s": wall}, f)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this module
    main()
