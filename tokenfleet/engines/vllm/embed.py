"""A sentence-transformers model embedded by vLLM's pooling runner, in the worker's own process.

tokenfleet keeps the text side as with the native engine (the directory's pipeline, its tokenizer
and truncation, the batching rule, cutting to ``dimensions`` and normalising); vLLM gets token ids
and returns each input's pooled vector un-normalised (``use_activation=False``), so both engines
answer the same request the same way."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tokenfleet.config import WorkerConfig
from tokenfleet.engines.embed.model import EmbedModel

log = logging.getLogger(__name__)

BATCH_TOKENS = 8192
# sentence-transformers' poolings vLLM's pooler computes the same way (it maps the others by their
# names' prefixes: mean_sqrt_len_tokens to mean, max_tokens to the architecture's default)
VLLM_POOLINGS = ("cls_token", "mean_tokens", "lasttoken")


class VllmEmbedder(EmbedModel):
    """The model at ``directory`` run by ``engine`` (an ``LLMEngine`` started with the pooling
    runner on the same directory)."""

    backend = "vllm"

    def __init__(self, directory: str | Path, engine: Any):
        self.engine = engine
        model_config = engine.model_config
        super().__init__(directory, int(model_config.max_model_len))
        if self.pipeline.pooling not in VLLM_POOLINGS:  # vLLM would pool another way, silently
            raise ValueError(
                f"{directory}: pooling {self.pipeline.pooling} is not one vLLM computes as "
                "sentence-transformers does; use --engine native"
            )
        self.vocab_size = min(self.vocab_size, int(model_config.get_vocab_size()))
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: WorkerConfig) -> VllmEmbedder:
        """Start vLLM's pooling runner for ``config``'s model (in this process: a worker killed
        with it leaves no engine behind)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLMEngine

        directory = config.engine.model or ""
        args = embed_engine_args(config, EmbedModel(directory).max_tokens)
        log.info("starting vLLM's pooling runner for %s (%s)", directory, args.dtype)
        return cls(directory, LLMEngine.from_engine_args(args))

    def pooled(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Each input's pooled vector: all handed to vLLM at once, its scheduler batches them."""
        from vllm import PoolingParams

        params = PoolingParams(task="embed", use_activation=False)  # normalised on our side
        order: dict[str, int] = {}
        out = torch.empty(len(inputs), self.pipeline.dimension)
        try:
            for i, ids in enumerate(inputs):
                request_id = f"embed-{next(self._ids)}"
                self.engine.add_request(request_id, {"prompt_token_ids": list(ids)}, params)
                order[request_id] = i
            while order:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM dropped {len(order)} embedding requests without output")
                for result in self.engine.step():
                    if result.finished and result.request_id in order:
                        out[order.pop(result.request_id)] = result.outputs.data.float().cpu()
        finally:
            if order:  # a failed step: nothing of this batch stays in vLLM
                self.engine.abort_request(list(order))
        return out


def embed_engine_args(config: WorkerConfig, max_tokens: int) -> Any:
    """vLLM's ``EngineArgs`` for an embedding model: the pooling runner, the model's own length
    (as ``max_model_len``), ``max_batch_size`` as ``max_num_seqs``, no sampling-side settings."""
    from vllm.engine.arg_utils import EngineArgs

    from tokenfleet.engines.native.device import select_device, select_dtype
    from tokenfleet.engines.vllm.args import CPU_MEMORY_UTILIZATION

    device = select_device(config.engine.device)
    # float32 on the CPU unless asked, as the native engine: sentence-transformers' own vectors
    dtype = "float32" if config.engine.dtype == "auto" and device.type == "cpu" else config.engine.dtype
    dtype = str(select_dtype(dtype, device)).removeprefix("torch.")
    longest = min(max_tokens, config.batching.max_seq_len)
    return EngineArgs(
        model=config.engine.model,
        runner="pooling",
        dtype=dtype,
        max_model_len=longest,
        max_num_seqs=config.batching.max_batch_size,
        # vLLM packs a step's inputs up to this; past it activations grow and run no faster
        max_num_batched_tokens=max(longest, min(BATCH_TOKENS, config.batching.max_batch_size * longest)),
        seed=0,
        gpu_memory_utilization=CPU_MEMORY_UTILIZATION if device.type == "cpu" else 0.9,
        disable_log_stats=True,
    )
