"""A text prompt's length in tokens, bounded before it is tokenized: no token decodes to more
characters than the vocabulary's longest, so a text of ``C`` characters is at least
``C / max_token_chars`` tokens. A prompt too long for every bucket by that bound is refused
without tokenizing it, by the producers (the gateway) and the workers alike."""

from __future__ import annotations

from typing import Any


def max_token_chars(tokenizer: Any) -> int:
    """Most characters one token of ``tokenizer``'s vocabulary decodes to (``transformers`` or
    ``tokenizers``: both have ``get_vocab``)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(1, longest + 1)  # +1: byte-level markers and word-boundary spaces


def cannot_fit(chars: int, largest_bucket: int, token_chars: int) -> bool:
    """Whether ``chars`` characters are more tokens than ``largest_bucket``, however tokenized."""
    return chars > largest_bucket * token_chars
