"""Per-request state while it runs: tokens, incremental detokenization, stop conditions, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.protocol import FinishReason, Request, TokenLogprob


class Detokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding the whole text,
    holding back bytes that do not yet form a complete character (byte-level tokenizers)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids up to here have produced their text
        # a fast tokenizer without clean-up decodes exactly as its Rust backend does: call that
        # directly, skipping transformers' Python twice per token of every sequence
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=True))
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back, at the end of the sequence."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


@dataclass
class SeqState:
    """A request being generated. ``key`` identifies it to the allocator and the caller."""

    key: Any
    request: Request
    prompt_ids: list[int]
    tokenizer: Any
    eos_ids: frozenset[int]
    enqueued_wall: float  # wall-clock time the request entered Redis
    generated: list[int] = field(default_factory=list)
    text: str = ""  # generated text decided so far (stop strings cut here)
    sent_text_len: int = 0
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    started: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prev_token_at: float | None = None
    batch_size: int = 0
    decode_steps: int = 0
    batch_size_sum: int = 0
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache held when it first started
    resumed_tokens: int = 0  # tokens already streamed by an earlier attempt, not re-sent
    unsent_ids: list[int] = field(default_factory=list)  # made but not yet published (coalescing)
    unsent_text: str = ""
    last_sent_at: float = 0.0  # monotonic time of the last token event
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    taken_at: float = field(default_factory=time.time)  # when this worker took it from Redis
    matcher: Any = None  # the output's grammar state (llguidance), for a ``response_format``
    adapter_path: str | None = None  # where its ``adapter`` lies on this worker's disk (the fleet's registry)

    def __post_init__(self) -> None:
        self.detok = Detokenizer(self.tokenizer)
        self.sampling_seed: int | None = None  # a sampled request's seed: its own, or drawn on first use
        self.sampling_error: str | None = None  # why a step could not choose this row's token
        self._holdback = max((len(s) for s in self.request.stop), default=1) - 1

    # sampling parameters, read by sampling.choose_tokens
    @property
    def temperature(self) -> float:
        return self.request.temperature

    @property
    def top_p(self) -> float:
        return self.request.top_p

    @property
    def top_k(self) -> int:
        return self.request.top_k

    @property
    def cache_salt(self) -> bytes:
        """What its KV blocks are named under besides their tokens: a prefix computed for one
        tenant is never found for another (nor can its timing tell them apart), one computed under
        one adapter (its name and directory) never for another, or for the base model."""
        tenant = b"" if self.request.tenant is None else b"tenant:" + self.request.tenant.encode() + b"\0"
        if self.request.adapter is None:
            return tenant
        return (
            tenant + b"adapter:" + self.request.adapter.encode() + b"\0" + (self.adapter_path or "").encode()
        )

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> None:
        """Add one generated token and decide whether the sequence is finished (the grammar, if
        any, has allowed it: the logits were masked by it)."""
        now = time.time()
        if self.first_token_at is None:
            self.first_token_at = now
        self.prev_token_at, self.last_token_at = self.last_token_at, now
        self.generated.append(token_id)
        searched = len(self.text)
        self.text += self.detok.push(token_id)
        req = self.request
        grammar_done = self.matcher is not None and self._grammar_done(token_id)
        if (
            grammar_done
            or (not req.ignore_eos and token_id in self.eos_ids)
            or token_id in req.stop_token_ids
        ):
            self.finish_reason = FinishReason.STOP
        elif len(self.generated) >= req.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            self.text += self.detok.flush()
        if req.stop and len(self.generated) > req.min_tokens and self._cut_at_stop_string(searched):
            self.finish_reason = FinishReason.STOP

    def _grammar_done(self, token_id: int) -> bool:
        """Feed the token to the grammar; True once the grammar allows nothing more (its end,
        or EOS taken where it accepts)."""
        self.matcher.consume_token(token_id)
        return bool(self.matcher.is_stopped() or self.matcher.is_error())

    def _cut_at_stop_string(self, searched: int) -> bool:
        """Cut the text before the first stop string; only text after ``searched`` (minus the
        longest stop string) can hold a new match."""
        start = max(0, searched - self._holdback)
        hits = [(i, s) for s in self.request.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, self.stop_string = min(hits)
        self.text = self.text[:at]
        return True

    def resume(self, token_ids: list[int], sent_texts: list[str]) -> None:
        """Continue after an earlier attempt that streamed ``token_ids`` (and ``sent_texts``):
        they become generated tokens, recomputed with the prompt at the next prefill, and the
        text already sent is not sent again."""
        for token_id in token_ids:
            self.generated.append(token_id)
            self.text += self.detok.push(token_id)
        if self.matcher is not None and token_ids:  # the grammar goes on from where it stopped
            self.matcher.consume_tokens(token_ids)
        self.sent_text_len = min(len(self.text), sum(len(t) for t in sent_texts))
        self.resumed_tokens = len(token_ids)
        if len(self.generated) >= self.request.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    def take_text_delta(self) -> str:
        """Text that is safe to send now: all of it when finished, otherwise all but a tail that
        could still turn out to start a stop string."""
        end = (
            len(self.text)
            if self.finished or not self.request.stop
            else max(self.sent_text_len, len(self.text) - self._holdback)
        )
        delta = self.text[self.sent_text_len : end]
        self.sent_text_len = end
        return delta

    def timings(self, finished_at: float) -> dict[str, float]:
        started = self.started or finished_at
        first = self.first_token_at or finished_at
        return {
            "queue_ms": round(max(0.0, started - self.enqueued_wall) * 1000, 3),
            "ttft_ms": round(max(0.0, first - self.enqueued_wall) * 1000, 3),
            "total_ms": round(max(0.0, finished_at - self.enqueued_wall) * 1000, 3),
        }

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_sum / self.decode_steps if self.decode_steps else float(self.batch_size)
