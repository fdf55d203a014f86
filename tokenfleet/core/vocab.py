"""Facts of a model's vocabulary that every backend needs the same way: its end-of-sequence ids
and chat messages rendered with its template (the longest text one token decodes to is the
protocol's: :mod:`tokenfleet.protocol.request`)."""

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


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, generation prompt added
    (transformers returns a plain list or an encoding, by version)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
