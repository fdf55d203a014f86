"""What every engine core does the same way before its engine sees a request: admission's checks,
then the batching rule's queue (lanes, buckets, the wait). The native and the vLLM core both
build on :class:`CoreFront`, so a request is refused, queued and dispatched alike whatever the
engine behind it. No Redis, no torch."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable
from typing import Any

from tokenfleet.batcher import Batcher
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.admission import Admission, Limits
from tokenfleet.core.grammar import Grammars
from tokenfleet.core.interface import ModelFacts
from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import ErrorCode, Refusal, Request


class CoreFront:
    """Admission and the waiting queue of an engine core; the core adds what runs."""

    def __init__(
        self,
        facts: ModelFacts,
        limits: Limits,
        batching: DynamicBatchingConfig,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.facts = facts
        self.config = batching
        self.admission = Admission(limits)
        self.batcher = Batcher(batching, clock)
        self.grammars = Grammars(facts.tokenizer, facts.vocab_size, facts.eos_token_ids)

    def output_constraint(self, request: Request) -> Any:
        """The grammar state the request's output must follow (None without a ``response_format``),
        or a :class:`Refusal` when its output controls cannot work with this model."""
        vocab = self.facts.vocab_size
        outside = [token for token, _ in request.logit_bias if token >= vocab]
        if outside:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"logit_bias names token {outside[0]}, outside the model's vocabulary of {vocab}",
            )
        if request.response_format is None:
            return None
        return self.grammars.matcher(request.response_format)

    def embed_ids(self, request: Request) -> list[int] | Refusal:
        """Embedding requests' ids; a core whose model does not embed refuses them."""
        return Refusal(
            ErrorCode.INVALID_REQUEST,
            "this worker serves a text generation model and does not embed: send embedding requests "
            "to a fleet serving an embedding model",
        )

    def add(self, seq: SeqState, arrived: float) -> Refusal | None:
        """Queue a sequence (``arrived``: monotonic time it entered the queue, for max_wait_ms);
        a :class:`Refusal` if it can never run here."""
        return self.admission.queue(seq, arrived, self.batcher)

    def waiting(self) -> list[SeqState]:
        """Queued, not yet dispatched."""
        return [item.payload for item in self.batcher.pending()]

    def remove_waiting(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Drop the queued sequences with these keys; returns them."""
        return [item.payload for item in self.batcher.remove(lambda item: item.key in keys)]

    def ready_at(self) -> float | None:
        """When an idle core will next have a batch due (see :meth:`Batcher.ready_at`)."""
        return self.batcher.ready_at()

    def set_wait(self, lane: int, seconds: float) -> None:
        self.batcher.set_wait(lane, seconds)
