"""The values the native core and its model runner pass each other, and what the core needs of a
runner: kept apart from both, so that neither imports the other for its types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenfleet.config import KVCacheConfig
from tokenfleet.core.interface import ModelFacts
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.lora.pool import LoraPool
from tokenfleet.protocol import TokenLogprob

# What a prefill returns per prompt, from one forward's final hidden states [tokens, hidden], each
# prompt's last row in them, its length and its place in the prefill (default: next-token logits)
PrefillHead = Callable[[Any, Any, list[int], list[int]], Any]


@dataclass(frozen=True)
class PrefillResult:
    """A prefill's next-token logits ``[B, vocab]`` (or its head's rows) and what it computed: tokens (padding
    included) in how many forwards."""

    logits: Any
    computed_tokens: int
    forwards: int


@dataclass(frozen=True)
class Chosen:
    """A step's token for each row (None: the row could not be sampled, ``sampling_error`` says
    why) and its logprobs where the request asked for them."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None]


class Runner(Protocol):
    """What the core needs of a model runner (:class:`tokenfleet.engines.native.runner.ModelRunner`):
    the pool it holds (``kv``: the config it was built from; ``num_blocks``: what it came to)."""

    kv: KVCacheConfig
    num_blocks: int
    bytes_per_block: int
    lora: LoraPool | None  # the adapters it holds (None: it serves none)
    hidden_size: int

    def facts(self) -> ModelFacts: ...

    def prefill(
        self,
        tables: list[list[int]],
        token_lists: list[list[int]],
        cached: list[int] | None,
        slots: list[int] | None,
        head: PrefillHead | None = None,
    ) -> PrefillResult: ...

    def decode(
        self, tables: list[list[int]], lengths: list[int], last_tokens: list[int], slots: list[int] | None
    ) -> Any: ...

    def start_masks(self, seqs: list[SeqState]) -> Any: ...

    def choose_tokens(self, logits: Any, seqs: list[SeqState], masks: Any) -> Chosen: ...
