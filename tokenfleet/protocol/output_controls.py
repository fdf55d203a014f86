"""The request fields that shape what a model may emit and what it reports: ``response_format``
(a JSON schema, any JSON object, a regex or a Lark grammar) and ``logit_bias``. Checked here,
before any worker spends a step on them; compiling a grammar is the worker's job."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tokenfleet.protocol.constants import MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
"""``response_format.type`` values: OpenAI's three, and ``regex`` / ``grammar`` (Lark) as ours."""


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the output: ``type`` one of :data:`FORMAT_TYPES` (not ``text``, which is no
    constraint), ``source`` the schema as canonical JSON, the regex or the Lark text ("" for
    ``json_object``), ``name`` the schema's name where one was given."""

    type: str
    source: str = ""
    name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        if self.type == "json_schema":
            spec: dict[str, Any] = {"schema": json.loads(self.source)}
            if self.name is not None:
                spec["name"] = self.name
            return {"type": self.type, "json_schema": spec}
        if self.type in ("regex", "grammar"):
            return {"type": self.type, self.type: self.source}
        return {"type": self.type}


def parse_response_format(value: Any) -> ResponseFormat | None:
    """A ``response_format`` map as a :class:`ResponseFormat` (None for ``text``); raises
    ``ValueError`` with the reason. A schema may come as a map or as its JSON text."""
    if not isinstance(value, dict) or value.get("type") not in FORMAT_TYPES:
        raise ValueError(f"response_format must be a map whose type is one of {', '.join(FORMAT_TYPES)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(kind)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format json_schema needs a json_schema map holding its schema")
        schema, name = spec.get("schema"), spec.get("name")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"response_format's schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format's schema must be a JSON schema (a map)")
        if name is not None and not isinstance(name, str):
            raise ValueError("response_format's json_schema name must be a string")
        try:  # keys keep their order: a schema's property order is the output's
            source = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"response_format's schema is not plain JSON: {e}") from None
        return _sized(ResponseFormat(kind, source, name))
    text = value.get(kind)
    if not isinstance(text, str) or not text:
        raise ValueError(f"response_format {kind} needs a non-empty string field {kind!r}")
    return _sized(ResponseFormat(kind, text))


def _sized(fmt: ResponseFormat) -> ResponseFormat:
    if len(fmt.source.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"response_format's {fmt.type} is larger than {MAX_GRAMMAR_BYTES} bytes")
    return fmt


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: a map from token id (an integer, or its decimal string as OpenAI sends it)
    to a number in [-100, 100], added to that token's logit. Raises ``ValueError``."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must be a map of at most {MAX_LOGIT_BIAS} token ids to numbers")
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 31:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be numbers, got {bias!r}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


_SUBSCHEMA = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its
    properties and says nothing of others: a model asked for a pydantic model's fields gets those
    fields alone (OpenAI's strict mode; vLLM's ``disable-additional-properties``)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    return out
