"""The Batch API's lines in OpenAI's format: an input line's endpoint and body, and an output or
error line from a completion's results. Shared by the gateway's batch jobs and `tokenfleet
batch`. No I/O."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tokenfleet.errors import RequestFailed
from tokenfleet.producer.openai.controls import Decode, token_id_text
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


def body_of_line(line: dict[str, Any]) -> tuple[Kind, CompletionBody | ChatBody]:
    """A Batch API input line's endpoint and body; ``ValueError`` saying what is wrong."""
    url, method = line.get("url"), line.get("method", "POST")
    if method != "POST" or url not in (COMPLETIONS, CHAT_COMPLETIONS):
        raise ValueError(
            f"method and url must be POST {COMPLETIONS} or {CHAT_COMPLETIONS}, got {method} {url}"
        )
    try:
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
    completion: Completion,
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
    else:
        status, body = 200, completion.response(outcome, decode)
    response = {"status_code": status, "request_id": completion.id, "body": body}
    return {
        "id": f"batch_req_{completion.id}_{index}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }
