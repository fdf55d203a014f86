"""The engine core's interface: what the worker loop, the demo and the benches drive.

A core takes sequences (:meth:`EngineCore.add`), runs one forward pass per :meth:`EngineCore.step`
and says what each produced; :meth:`EngineCore.abort` removes sequences wherever they are. Every
core shares admission (:mod:`tokenfleet.core.admission`), the batching rule
(:class:`~tokenfleet.batcher.Batcher`) and the text side (:class:`~tokenfleet.core.sequence.SeqState`:
deltas, stop strings, finish reasons); a backend only turns token ids into next token ids. No
Redis here.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenfleet.core.admission import Admission
from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import Refusal, Request, TokenLogprob
from tokenfleet.protocol.adapters import AdapterRecord


@dataclass(frozen=True)
class TokenOutput:
    """One token a step produced for one sequence, with the text now safe to stream."""

    seq: SeqState
    index: int  # position of ``token_id`` among the generated tokens
    token_id: int
    text: str
    logprob: TokenLogprob | None = None  # where the request asked for logprobs

    @property
    def finished(self) -> bool:
        return self.seq.finished

    @classmethod
    def append(cls, seq: SeqState, token_id: int, logprob: TokenLogprob | None = None) -> TokenOutput:
        """Append a token a backend chose to its sequence: the one place where a token becomes
        text, a stop string cuts it or a finish reason ends it, whatever the backend."""
        seq.append(token_id)
        return cls(seq, len(seq.generated) - 1, token_id, seq.take_text_delta(), logprob)


@dataclass(frozen=True)
class BatchEvent:
    """A forward pass the core ran, for logs, metrics and the demo."""

    kind: str  # "prefill" or "decode"
    size: int
    computed_tokens: int = 0  # prefill: tokens the forwards ran, padding included
    forwards: int = 1
    padding_waste: float = 0.0  # prefill: padding tokens / prompt tokens
    prompt_tokens: int = 0  # prefill: the prompts' own tokens (what max_prefill_tokens bounds)

    def describe(self) -> str:
        """What the pass computed, for the log line of each prefill."""
        if self.kind != "prefill":
            return self.kind
        return (
            f"prefill, {self.computed_tokens} tokens in {self.forwards} forward(s), "
            f"padding waste {self.padding_waste:.2f}"
        )


@dataclass(frozen=True)
class StepOutput:
    """What one step did: tokens per sequence (in order), the sequences it finished (their last
    token among ``tokens``), those it preempted, those that failed alone (each with a message;
    already out of the core, to be answered with an error), and the forward passes it ran."""

    tokens: list[TokenOutput] = field(default_factory=list)
    preempted: list[SeqState] = field(default_factory=list)
    failed: list[tuple[SeqState, str]] = field(default_factory=list)
    batches: list[BatchEvent] = field(default_factory=list)
    refused: list[tuple[SeqState, Refusal]] = field(default_factory=list)  # e.g. an adapter that cannot load
    embedded: list[tuple[SeqState, bytes]] = field(default_factory=list)  # vectors, little-endian float32

    @property
    def finished(self) -> list[SeqState]:
        return [t.seq for t in self.tokens if t.finished]

    def __bool__(self) -> bool:
        return bool(self.tokens or self.batches or self.refused or self.embedded)


@dataclass(frozen=True)
class Capacity:
    """What the core can hold, and holds now (heartbeat, metrics, ``tokenfleet status``)."""

    max_seq_len: int
    block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    kv_bytes_per_block: int = 0  # 0: not known (the backend does not say)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # ... of which it held the K/V
    adapters: tuple[str, ...] = ()  # LoRA adapters resident

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_bytes_used(self) -> int:
        return self.kv_blocks_used * self.kv_bytes_per_block

    def contiguous_bytes(self, batch_size: int, max_seq_len: int) -> int:
        """Bytes a cache preallocated for ``batch_size x max_seq_len`` tokens would take (what the
        paged pool is compared with)."""
        return batch_size * max_seq_len * self.kv_bytes_per_block // max(1, self.block_size)


@dataclass(frozen=True)
class ModelFacts:
    """What the worker needs to know of the model: to tokenize, to end sequences, to report."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    max_token_chars: int  # most characters one token decodes to
    device: str
    dtype: str
    task: str = "generate"  # or "embed": an embedding model's worker (the heartbeat says which)


class EngineCore(Protocol):
    """The seam between the queue and an engine. Implemented by
    :class:`tokenfleet.engines.native.core.NativeCore` and
    :class:`tokenfleet.engines.vllm.core.VllmCore`, both on :class:`tokenfleet.core.front.CoreFront`."""

    backend: str  # "native" or "vllm", for logs, the heartbeat and ``tokenfleet status``
    facts: ModelFacts
    admission: Admission

    def output_constraint(self, request: Request) -> Any:
        """The grammar state a request's output must follow (None: unconstrained), or the
        :class:`Refusal` of output controls this core cannot honour."""
        ...

    def embed_ids(self, request: Request) -> list[int] | Refusal:
        """The token ids an embedding request's prompt makes for this model (truncated as its
        ``embed.truncate`` says), or the :class:`Refusal` of a core that cannot embed it."""
        ...

    def add(self, seq: SeqState, arrived: float) -> Refusal | None:
        """Queue a sequence (``arrived``: monotonic time it entered the queue, for max_wait_ms);
        a :class:`Refusal` if it can never run here."""
        ...

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        """Remove the sequences with these keys wherever they are; returns those removed. No
        token of theirs comes out of a later step."""
        ...

    def preload(self, adapters: list[AdapterRecord]) -> None:
        """Start loading these adapters now (a worker's ``--lora``): the first requests that name
        them need not wait. A core that loads adapters on its own (vLLM's) may do nothing."""
        ...

    def open_parked(self) -> list[tuple[SeqState, Refusal]]:
        """Queue the sequences parked while their adapter loaded, now that it has; returns those
        refused because it cannot load. Called before each :meth:`step`, apart from it, so that a
        step that raises loses no refusal."""
        ...

    def step(self, flush: bool = False) -> StepOutput:
        """Run one forward pass if one is due. ``flush`` starts waiting requests without waiting
        for their batch to be due (shutdown)."""
        ...

    @property
    def has_work(self) -> bool:
        """A step would run something now."""
        ...

    def ready_at(self) -> float | None:
        """When an idle core will next have a batch due (monotonic), None: not without arrivals."""
        ...

    def set_wait(self, lane: int, seconds: float) -> None:
        """How long ``lane``'s batches wait to fill from now on (``max_wait_ms`` until set; a TTFT
        target moves it at run time)."""
        ...

    def held(self) -> list[SeqState]:
        """Every sequence the core holds: running, preempted and waiting."""
        ...

    def running(self) -> list[SeqState]:
        """The sequences that have started (running or preempted)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Taken from the queue, not yet started (the no-hoarding bound applies to this)."""
        ...

    def waiting_in(self, lane: int) -> int:
        """Of those, the ones of one priority lane."""
        ...

    def capacity(self) -> Capacity: ...

    def check_idle(self) -> None:
        """Integrity checks that hold when nothing runs (e.g. every KV block free); raises
        ``RuntimeError`` on a leak."""
        ...

    def close(self) -> None: ...
