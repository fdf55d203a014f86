"""The engine core of an embedding model's worker: requests queue and batch under the same rules
as generation (lanes, buckets, ``max_wait_ms``, ``max_batch_size``), and a step runs one batch's
forward passes (no KV kept) and hands back each request's vector. No Redis here."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import replace

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Limits
from tokenfleet.core.front import CoreFront
from tokenfleet.core.interface import BatchEvent, Capacity, ModelFacts, StepOutput
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.embed.model import EmbedModel, vector_bytes
from tokenfleet.protocol import ErrorCode, Refusal, Request
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.protocol.embed import EmbedSpec
from tokenfleet.protocol.request import max_token_chars

_POOLING_NAMES = {"mean_tokens": "mean", "lasttoken": "last"}  # the wire's names of the model's own


class EmbedCore(CoreFront):
    """The :class:`~tokenfleet.core.interface.EngineCore` of a sentence-transformers model, whichever
    engine runs its forward passes (``embedder``: torch's, or vLLM's pooling runner)."""

    def __init__(
        self,
        embedder: EmbedModel,
        batching: DynamicBatchingConfig,
        device: str = "cpu",
        clock: Callable[[], float] = time.monotonic,
    ):
        tokenizer = embedder.tokenizer
        facts = ModelFacts(
            tokenizer=tokenizer,
            eos_token_ids=frozenset(),
            vocab_size=embedder.vocab_size,
            max_token_chars=max_token_chars(tokenizer),
            device=device,
            dtype=embedder.dtype,
            task="embed",
        )
        limits = Limits(
            buckets=batching.buckets,
            max_seq_len=batching.max_seq_len,
            max_new_tokens_cap=batching.max_new_tokens_cap,
            vocab_size=facts.vocab_size,
            max_token_chars=facts.max_token_chars,
            kv_tokens_per_seq=embedder.max_tokens,  # no KV: the model's own length is the bound
        )
        # one step packs its inputs end to end whatever their lengths: mixing buckets pads nothing
        batching = replace(batching, mix_buckets=True, padding=None)
        super().__init__(facts, limits, batching, clock)
        self.embedder = embedder
        self.backend = embedder.backend
        self._running: list[SeqState] = []  # the batch of the step in progress (a failed one aborts it)

    # -- what it takes --------------------------------------------------------------------------

    def embed_ids(self, request: Request) -> list[int] | Refusal:
        """The ids the model embeds for ``request`` (text tokenized as sentence-transformers does,
        truncated to the model's length unless ``embed.truncate`` is false), or its refusal."""
        spec = request.embed or EmbedSpec()
        refusal = self._check_spec(spec)
        if refusal is not None:
            return refusal
        longest = self.embedder.max_tokens
        if request.input_ids is not None:
            ids = list(request.input_ids)
            refusal = self.admission.check_ids(ids)
            if refusal is not None:
                return refusal
        else:
            ids = self.embedder.tokenize([request.prompt or ""], truncate=spec.truncate)[0]
        if len(ids) > longest and (not spec.truncate or request.input_ids is not None):
            # token ids are the caller's own: cutting them would drop its closing special token
            return Refusal(
                ErrorCode.PROMPT_TOO_LONG, f"input has {len(ids)} tokens; this model embeds at most {longest}"
            )
        return ids[:longest]

    def _check_spec(self, spec: EmbedSpec) -> Refusal | None:
        pipeline = self.embedder.pipeline
        if spec.dimensions is not None and spec.dimensions > pipeline.dimension:
            message = f"dimensions {spec.dimensions} is more than the model's {pipeline.dimension}"
            return Refusal(ErrorCode.INVALID_REQUEST, message)
        own = _POOLING_NAMES.get(pipeline.pooling, pipeline.pooling)
        if spec.pooling is not None and spec.pooling != own:
            message = f"this model pools by {own} (its config); pooling {spec.pooling} is not offered"
            return Refusal(ErrorCode.INVALID_REQUEST, message)
        return None

    def add(self, seq: SeqState, arrived: float) -> Refusal | None:
        if seq.request.embed is None:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                "this worker serves an embedding model: it embeds (embed) and does not generate text",
            )
        return super().add(seq, arrived)

    def preload(self, adapters: list[AdapterRecord]) -> None:
        """Adapters are refused by the protocol for embedding requests: nothing to load."""

    def open_parked(self) -> list[tuple[SeqState, Refusal]]:
        return []

    # -- stepping -------------------------------------------------------------------------------

    def step(self, flush: bool = False) -> StepOutput:
        """Embed the batch that is due (``flush``: whatever waits), in one call of the model."""
        batch = self.batcher.next_batch()
        if batch is None and flush:
            batch = self.batcher.take(self.config.max_batch_size)
        if batch is None:
            return StepOutput()
        seqs: list[SeqState] = [item.payload for item in batch.items]
        started = time.time()
        for seq in seqs:
            seq.started, seq.batch_size = started, len(seqs)
        self._running = seqs
        vectors = self.embedder.embed([seq.prompt_ids for seq in seqs], normalize=False)
        ended = time.time()
        out = []
        for seq, vector in zip(seqs, vectors, strict=True):
            seq.first_token_at = ended
            spec = seq.request.embed or EmbedSpec()
            out.append((seq, vector_bytes(vector, spec, self.embedder.pipeline.normalize)))
        self._running = []  # only now: a failure above leaves them to be aborted and answered
        real = batch.prompt_tokens
        event = BatchEvent("prefill", len(seqs), real, 1, 0.0, prompt_tokens=real)
        return StepOutput(embedded=out, batches=[event])

    # -- what it holds --------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.batcher.is_due()

    def held(self) -> list[SeqState]:
        return [*self._running, *self.waiting()]

    def running(self) -> list[SeqState]:
        return list(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher)

    def waiting_in(self, lane: int) -> int:
        return self.batcher.waiting_in(lane)

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        running = [seq for seq in self._running if seq.key in keys]
        self._running = [seq for seq in self._running if seq.key not in keys]
        return running + self.remove_waiting(keys)

    def capacity(self) -> Capacity:
        return Capacity(
            max_seq_len=self.embedder.max_tokens,
            block_size=1,
            kv_blocks_total=0,
            kv_blocks_used=0,
            running=len(self._running),
            waiting=len(self.batcher),
        )

    def check_idle(self) -> None:
        """Nothing is kept between steps: nothing can leak."""

    def close(self) -> None:
        """Nothing to release beyond the model, which goes with the process."""
