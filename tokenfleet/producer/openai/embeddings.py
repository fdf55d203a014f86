"""OpenAI's embeddings request and response bodies (``/v1/embeddings``): shared by the gateway's
route and the Batch API's lines. No I/O."""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.producer.embeddings import embed_inputs, vector_or_raise
from tokenfleet.producer.result import Result

EMBEDDINGS = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingBody(BaseModel):
    """OpenAI's fields, and ``truncate`` (ours: inputs longer than the model takes are cut as
    sentence-transformers cuts them; false: refused). Anything else is refused by name."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = True

    def submissions(self) -> list[dict[str, Any]]:
        """``submit`` arguments of each input (one embedding request each); ``ValueError`` for
        an empty input or too many."""
        if self.input in ([], [[]]):
            raise ValueError("input must not be empty")
        calls = embed_inputs(self.input)
        if len(calls) > MAX_INPUTS:
            raise ValueError(f"input holds {len(calls)} items; at most {MAX_INPUTS} allowed")
        spec: dict[str, Any] = {"truncate": self.truncate}
        if self.dimensions is not None:
            spec["dimensions"] = self.dimensions
        return [{**call, "embed": spec} for call in calls]

    def response(self, results: list[Result]) -> dict[str, Any]:
        """OpenAI's response: a list of embeddings in input order, and the tokens embedded."""
        data = []
        for index, result in enumerate(results):
            vector = vector_or_raise(result)
            encoded: Any = vector.tolist()
            if self.encoding_format == "base64":
                encoded = base64.b64encode(little_endian(vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(result.usage.get("prompt_tokens", 0) for result in results)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": self.model, "usage": usage}


def little_endian(vector: array[float]) -> bytes:
    """A float32 vector's bytes as the wire and OpenAI's base64 have them."""
    if sys.byteorder == "little":
        return vector.tobytes()
    swapped = array("f", vector)
    swapped.byteswap()
    return swapped.tobytes()
