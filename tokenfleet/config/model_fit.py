"""Batching defaults that fit the model a worker serves: without ``--max-seq-len`` a worker serves
the model's whole context, and without ``--buckets`` its buckets grow x4 from 128 up to that, so a
prompt the model can take is never refused for want of a bucket. Reads the model directory's
``config.json`` (stdlib only: no transformers needed to decide)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenfleet.config.batching import DynamicBatchingConfig

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
FIRST_BUCKET = 128
BUCKET_GROWTH = 4


def model_context_length(model_dir: str) -> int | None:
    """The longest sequence the model at ``model_dir`` was built for (its text model's, for a
    multimodal config), or None where its ``config.json`` does not say."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config.get("text_config") or {}, config):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 1:
                return value
    return None


def buckets_up_to(max_seq_len: int) -> tuple[int, ...]:
    """128, 512, 2048, ... below ``max_seq_len``, then ``max_seq_len`` itself."""
    buckets, size = [], FIRST_BUCKET
    while size < max_seq_len:
        buckets.append(size)
        size *= BUCKET_GROWTH
    return (*buckets, max_seq_len)


def fit_to_model(
    batching: DynamicBatchingConfig, context: int | None, given: set[str]
) -> DynamicBatchingConfig:
    """``batching`` with ``max_seq_len`` (the model's ``context``, where known) and ``buckets`` (up
    to ``max_seq_len``) where no layer of the configuration named them (``given``)."""
    max_seq_len = batching.max_seq_len if "max_seq_len" in given or context is None else context
    buckets = batching.buckets if "buckets" in given else buckets_up_to(max_seq_len)
    return dataclasses.replace(batching, max_seq_len=max_seq_len, buckets=buckets)
