"""Embedding requests on a generation model's worker: the model's own final hidden states (after
its last norm), pooled over the prompt's tokens (``mean``, the default) or taken at its last token
(``last``), normalised unless the request says otherwise.

They queue under the worker's batching rule in a queue of their own and run as one packed forward
(the prefill's, with its kernels and linear routes) between generation steps: while generation
has work (sequences decoding, a batch due), never two embedding steps in a row, so a decode or a
prefill waits at most one embedding batch. Their
K/V go to blocks taken for that step and freed after it, unnamed: no prefix-cache entry is made
or read (a hit would skip the tokens the mean needs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import replace

import torch

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Admission
from tokenfleet.core.interface import BatchEvent, ModelFacts, StepOutput
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.embed.model import vector_bytes
from tokenfleet.engines.native.types import PrefillHead, Runner
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import ErrorCode, Refusal, Request
from tokenfleet.protocol.embed import EmbedSpec


class OwnEmbeds:
    """The embedding side of a native generation core: its queue, the batch running, the step."""

    def __init__(self, runner: Runner, batching: DynamicBatchingConfig, clock: Callable[[], float]):
        self.runner = runner
        # a step packs its prompts end to end whatever their lengths: mixing buckets pads nothing
        self.batcher = Batcher(replace(batching, mix_buckets=True, padding=None), clock)
        self.max_batch_size = batching.max_batch_size
        self.running: list[SeqState] = []  # the batch of the step in progress (a failed one aborts it)
        self.dimension = runner.hidden_size
        self._ran_last = False

    def ids(self, request: Request, facts: ModelFacts, admission: Admission) -> list[int] | Refusal:
        """The ids a request embeds (text tokenized as the model's tokenizer does, cut to the
        longest prompt this worker takes unless ``embed.truncate`` is false), or its refusal."""
        spec = request.embed or EmbedSpec()
        if spec.dimensions is not None and spec.dimensions > self.dimension:
            message = f"dimensions {spec.dimensions} is more than the model's {self.dimension}"
            return Refusal(ErrorCode.INVALID_REQUEST, message)
        limits = admission.limits
        longest = min(limits.largest_bucket, limits.max_seq_len, limits.kv_tokens_per_seq)
        if request.input_ids is not None:
            ids = list(request.input_ids)
            refusal = admission.check_ids(ids)
            if refusal is not None:
                return refusal
        else:
            ids = list(facts.tokenizer(request.prompt or "")["input_ids"])
        if len(ids) > longest and (not spec.truncate or request.input_ids is not None):
            message = f"input has {len(ids)} tokens; this worker embeds at most {longest}"
            return Refusal(ErrorCode.PROMPT_TOO_LONG, message)
        return ids[:longest]

    def is_due(self, generating: bool, flush: bool = False) -> bool:
        """Whether the next step embeds: a batch is due (or waits, at a flush), and no embedding
        step ran last while generation has work (``generating``)."""
        if generating and self._ran_last:
            return False
        return self.batcher.is_due() or (flush and len(self.batcher) > 0)

    def step(self, allocator: BlockAllocator, flush: bool = False) -> StepOutput:
        """Embed the batch that is due, as far as the KV pool holds it (the rest waits)."""
        self._ran_last = True
        batch = self.batcher.next_batch() or (self.batcher.take(self.max_batch_size) if flush else None)
        if batch is None:
            return StepOutput()
        placed: list[SeqState] = []
        unplaced: list[PendingRequest] = []
        for item in batch.items:
            seq = item.payload
            if unplaced or allocator.allocate(_key(seq), seq.prompt_ids, cache=False) is None:
                unplaced.append(item)
            else:
                placed.append(seq)
        if unplaced:
            self.batcher.requeue(unplaced)
        if not placed:  # the pool is full: they wait for blocks (generation frees them as it ends)
            return StepOutput()
        started = time.time()
        for seq in placed:
            seq.started, seq.batch_size = started, len(placed)
        self.running = placed
        tables = [allocator.block_table(_key(seq)) for seq in placed]
        poolings = [(seq.request.embed or EmbedSpec()).pooling or "mean" for seq in placed]
        try:
            prompts = [seq.prompt_ids for seq in placed]
            result = self.runner.prefill(tables, prompts, None, None, head=pooling_head(poolings))
            vectors = result.logits.float().cpu()
        except Exception as e:  # this batch fails alone: the sequences generating are not its
            self.running = []
            return StepOutput(failed=[(seq, f"the embedding pass failed: {e}") for seq in placed])
        finally:
            for seq in placed:
                allocator.free(_key(seq))
        ended = time.time()
        out = []
        for seq, pooled in zip(placed, vectors, strict=True):
            seq.first_token_at = ended
            out.append((seq, vector_bytes(pooled, seq.request.embed or EmbedSpec(), model_normalizes=True)))
        self.running = []  # only now: a failure above leaves them to be aborted and answered
        real = sum(len(seq.prompt_ids) for seq in placed)
        event = BatchEvent(
            "prefill", len(placed), result.computed_tokens, result.forwards, prompt_tokens=real
        )
        return StepOutput(embedded=out, batches=[event])

    def generation_ran(self) -> None:
        self._ran_last = False

    def waiting(self) -> list[SeqState]:
        return [item.payload for item in self.batcher.pending()]

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        running = [seq for seq in self.running if seq.key in keys]
        self.running = [seq for seq in self.running if seq.key not in keys]
        waiting = self.batcher.remove(lambda item: item.key in keys)
        return running + [item.payload for item in waiting]


def _key(seq: SeqState) -> tuple[str, Hashable]:
    """Its blocks' owner in the allocator: apart from any generation sequence's."""
    return ("embed", seq.key)


def pooling_head(poolings: list[str]) -> PrefillHead:
    """A prefill head that pools each prompt's final hidden states in float32 (``rows``: one
    forward's packed tokens; ``last``: each of its prompts' last row; ``lengths``: their token
    counts; ``prompts``: their places in the prefill, for ``poolings``)."""

    def head(rows: torch.Tensor, last: torch.Tensor, lengths: list[int], prompts: list[int]) -> torch.Tensor:
        pooled = []
        for end, length, i in zip(last.tolist(), lengths, prompts, strict=True):
            chosen = rows[end : end + 1] if poolings[i] == "last" else rows[end - length + 1 : end + 1]
            pooled.append(chosen.float().mean(0))
        return torch.stack(pooled)

    return head
