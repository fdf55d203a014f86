"""Facts of a model's vocabulary that every backend needs the same way: its end-of-sequence ids
and the longest text one token decodes to."""

from __future__ import annotations

from typing import Any


def eos_token_ids(generation_config: Any, model_config: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a sequence: the generation config's and the model config's, or the
    tokenizer's when neither names one."""
    ids: set[int] = set()
    for source in (generation_config, model_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def max_token_chars(tokenizer: Any) -> int:
    """Most characters one token decodes to (bounds a prompt's length from its token count)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(1, longest + 1)  # +1: byte-level markers and word-boundary spaces
