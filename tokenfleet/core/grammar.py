"""Grammars for constrained decoding, with llguidance: a request's ``response_format`` compiled
once per distinct schema (a cached matcher is copied for each sequence), its errors a refusal
before the request costs a batch-mate anything. No torch: the token masks are the engine's."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from tokenfleet.protocol import ErrorCode, Refusal
from tokenfleet.protocol.output_controls import (
    ResponseFormat,
    closed_objects,  # noqa: F401 (re-exported)
)

CACHED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first); a copy costs microseconds."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON: a small model free to add whitespace can spend its tokens on nothing else."""


def _limits() -> Any:
    import llguidance

    # bounded compile and per-token work: a hostile schema is refused, not a stalled worker
    return llguidance.LLParserLimits(
        initial_lexer_fuel=2_000_000, max_grammar_size=200_000, verbose_errors=False
    )


class Grammars:
    """Compiles ``response_format`` constraints for one tokenizer; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._tokenizer: Any = None  # llguidance's view of it, built on first use (~1 s)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, fmt: ResponseFormat) -> Any:
        """A fresh matcher for ``fmt``, or a :class:`Refusal` (``invalid_grammar``) saying why
        it cannot be compiled (or ``invalid_request`` where llguidance is not installed)."""
        try:
            import llguidance
        except ImportError:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                "this worker cannot constrain output: install llguidance (pip install 'tokenfleet[worker]')",
            )
        key = (fmt.type, fmt.source)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(llguidance, fmt)
                if isinstance(compiled, Refusal):
                    return compiled
                self._cache[key] = compiled
                if len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return compiled.deep_copy()

    def _compile(self, llguidance: Any, fmt: ResponseFormat) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids
            )
        Matcher = llguidance.LLMatcher
        try:
            if fmt.type == "json_object":
                grammar = Matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif fmt.type == "json_schema":
                schema = closed_objects(json.loads(fmt.source))
                grammar = Matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif fmt.type == "regex":
                grammar = Matcher.grammar_from_regex(fmt.source)
            else:
                grammar = Matcher.grammar_from_lark(fmt.source)
            matcher = Matcher(self._tokenizer, grammar, log_level=0, limits=_limits())
        except (ValueError, TypeError, RuntimeError) as e:
            return Refusal(ErrorCode.INVALID_GRAMMAR, f"response_format {fmt.type} cannot be compiled: {e}")
        if matcher.is_error():
            error = matcher.get_error().splitlines()[0][:500]
            return Refusal(
                ErrorCode.INVALID_GRAMMAR, f"response_format {fmt.type} cannot be compiled: {error}"
            )
        return matcher
