"""The Batch API's lines in OpenAI's format: an input line's endpoint and body, and an output or
error line from a completion's results. Shared by the gateway's batch jobs and `tokenfleet
batch`. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenfleet.errors import RequestFailed
from tokenfleet.producer.openai.controls import Decode, token_id_text
from tokenfleet.producer.openai.embeddings import EMBEDDINGS, EmbeddingBody
from tokenfleet.producer.openai.format import (
    CHAT_COMPLETIONS,
    CLIENT_ERROR_CODES,
    COMPLETIONS,
    ChatBody,
    Completion,
    CompletionBody,
    Kind,
)
from tokenfleet.producer.result import Result


@dataclass(frozen=True)
class EmbeddingLine:
    """A ``/v1/embeddings`` line of a batch: its requests' ids start with ``id``."""

    id: str
    body: EmbeddingBody

    def submissions(self, lane: str | None = None, **extra: Any) -> list[tuple[str, dict[str, Any]]]:
        """(request id, ``submit`` arguments) of each input (``extra``: more fields of each);
        ``ValueError`` for an empty one."""
        extra.update({"priority": lane} if lane else {})
        return [(f"{self.id}.{k}", {**call, **extra}) for k, call in enumerate(self.body.submissions())]


ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS)
"""The endpoints a Batch API line may name."""


def body_of_line(line: dict[str, Any]) -> tuple[Kind, CompletionBody | ChatBody] | tuple[str, EmbeddingBody]:
    """A Batch API input line's endpoint (``text``, ``chat`` or ``embed``) and body;
    ``ValueError`` saying what is wrong."""
    url, method = line.get("url"), line.get("method", "POST")
    if method != "POST" or url not in ENDPOINTS:
        raise ValueError(f"method and url must be POST and one of {', '.join(ENDPOINTS)}, got {method} {url}")
    try:
        if url == EMBEDDINGS:
            return "embed", EmbeddingBody.model_validate(line.get("body"))
        if url == CHAT_COMPLETIONS:
            return "chat", ChatBody.model_validate(line.get("body"))
        return "text", CompletionBody.model_validate(line.get("body"))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"body.{where}: {first.get('msg')}" if where else str(first.get("msg"))) from None


def output_line(
    index: int,
    custom_id: str,
    completion: Completion | EmbeddingLine,
    outcome: list[Result] | RequestFailed,
    decode: Decode = token_id_text,
) -> dict[str, Any]:
    """A Batch API output (or error) file line: OpenAI's ``id``, ``custom_id``, ``response`` with
    its ``status_code`` and ``body``, and ``error``."""
    if isinstance(outcome, RequestFailed):
        status = 400 if outcome.code in CLIENT_ERROR_CODES else 500
        body: dict[str, Any] = {
            "error": {
                "message": outcome.message,
                "type": "invalid_request_error",
                "param": None,
                "code": outcome.code,
            }
        }
    elif isinstance(completion, EmbeddingLine):
        status, body = 200, completion.body.response(outcome)
    else:
        status, body = 200, completion.response(outcome, decode)
    response = {"status_code": status, "request_id": completion.id, "body": body}
    return {
        "id": f"batch_req_{completion.id}_{index}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }
