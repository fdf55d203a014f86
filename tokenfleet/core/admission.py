"""Whether a request can ever run on this worker: every such check, in one place, as a value.

A :class:`Refusal` carries a stable protocol error code; ``None`` means the request may queue.
The checks run in a fixed, documented order (docs/PROTOCOL.md "Which error wins"), so a request
that breaks several limits always gets the same code, whatever the engine behind the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import ErrorCode, Refusal, Request, smallest_bucket
from tokenfleet.protocol.request import cannot_fit


@dataclass(frozen=True)
class Limits:
    """What bounds a request on one worker: its buckets and sequence length, its cap on new
    tokens, the model's vocabulary and the most tokens one sequence may hold in its KV cache."""

    buckets: tuple[int, ...]
    max_seq_len: int
    max_new_tokens_cap: int
    vocab_size: int
    max_token_chars: int  # most characters one token decodes to
    kv_tokens_per_seq: int  # tokens the whole KV cache holds for one sequence

    @property
    def largest_bucket(self) -> int:
        return max(self.buckets)


class Admission:
    """The checks, in order: the request's fields before any tokenizing (:meth:`check_cap`,
    :meth:`check_prompt_chars`, :meth:`check_ids`), then its token count (:meth:`check_tokens`)."""

    def __init__(self, limits: Limits):
        self.limits = limits

    def check_cap(self, request: Request) -> Refusal | None:
        """``max_new_tokens`` over this worker's cap."""
        cap = self.limits.max_new_tokens_cap
        if request.max_new_tokens > cap:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"max_new_tokens {request.max_new_tokens} is above this worker's cap of {cap}",
            )
        return None

    def check_prompt_chars(self, request: Request, largest_bucket: int | None = None) -> Refusal | None:
        """A text prompt too long to fit ``largest_bucket`` (default: this worker's) whatever its
        tokenization: no token decodes to more than ``max_token_chars`` characters, so it is
        refused without spending time tokenizing it."""
        largest = largest_bucket or self.limits.largest_bucket
        chars = sum(len(content) for _, content in request.messages) if request.messages else 0
        chars += len(request.prompt) if request.prompt is not None else 0
        if cannot_fit(chars, largest, self.limits.max_token_chars):
            return Refusal(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {chars} characters cannot fit the largest bucket ({largest} tokens)",
            )
        return None

    def check_ids(self, ids: Sequence[int]) -> Refusal | None:
        """Token ids a producer sent must name tokens of this model."""
        if ids and max(ids) >= self.limits.vocab_size:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"input_ids hold {max(ids)}, outside the model's vocabulary of {self.limits.vocab_size}",
            )
        return None

    def check_tokens(self, prompt_len: int, max_new_tokens: int) -> Refusal | None:
        """Refusals decided from the prompt's token count: empty, longer than every bucket,
        longer than ``max_seq_len`` with its new tokens, or more than the KV cache can hold."""
        lim = self.limits
        if prompt_len < 1:
            return Refusal(ErrorCode.INVALID_REQUEST, "the prompt has no tokens")
        if smallest_bucket(lim.buckets, prompt_len) is None:
            return Refusal(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt has {prompt_len} tokens; the largest bucket is {lim.largest_bucket}",
            )
        total = prompt_len + max_new_tokens
        if total > lim.max_seq_len:
            return Refusal(
                ErrorCode.MAX_SEQ_LEN_EXCEEDED,
                f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                f"({lim.max_seq_len})",
            )
        if total > lim.kv_tokens_per_seq:
            return Refusal(
                ErrorCode.CACHE_TOO_SMALL,
                f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) needs {total} KV slots; "
                f"this worker's cache holds {lim.kv_tokens_per_seq} for one sequence",
            )
        return None

    def queue(self, seq: SeqState, arrived: float, batcher: Batcher) -> Refusal | None:
        """Queue ``seq`` in ``batcher`` if its tokens pass :meth:`check_tokens` (every core's
        ``add``), else the refusal."""
        prompt_len, max_new = len(seq.prompt_ids), seq.request.new_tokens
        refusal = self.check_tokens(prompt_len, max_new)
        if refusal is None:
            item = PendingRequest(seq.key, prompt_len, max_new, arrived, payload=seq, lane=seq.request.lane)
            batcher.add(item)
        return refusal
