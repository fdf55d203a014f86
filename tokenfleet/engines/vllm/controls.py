"""The output controls vLLM honours for us, as ``SamplingParams`` fields, and its logprobs as our
token events' (:class:`~tokenfleet.protocol.TokenLogprob`). Grammars run in vLLM's ``guidance``
backend: the same llguidance, compact JSON and closed objects as the native engine."""

from __future__ import annotations

import json
from typing import Any

from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import ResponseFormat, TokenLogprob
from tokenfleet.protocol.output_controls import closed_objects


def control_kwargs(seq: SeqState) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for the request's penalties, bias, ``min_tokens`` and
    logprobs, for the tokens it has still to make."""
    req = seq.request
    kwargs: dict[str, Any] = {
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    if req.logit_bias:
        kwargs["logit_bias"] = dict(req.logit_bias)
    if req.logprobs is not None:
        kwargs["logprobs"] = req.logprobs
    if req.response_format is not None:
        kwargs["structured_outputs"] = structured_outputs(req.response_format)
    still = req.min_tokens - len(seq.generated)
    if still > 0:
        # vLLM ignores EOS for us (the end is ours), so it would not hold EOS back: name it a stop
        # token there, which min_tokens does hold back (and where it ends the request, so do we)
        ends = set(req.stop_token_ids) | (set() if req.ignore_eos else set(seq.eos_ids))
        kwargs.update(min_tokens=still, stop_token_ids=sorted(ends))
    return kwargs


def structured_outputs(fmt: ResponseFormat) -> Any:
    """vLLM's ``StructuredOutputsParams`` for a ``response_format``."""
    from vllm.sampling_params import StructuredOutputsParams

    match fmt.type:
        case "json_object":
            return StructuredOutputsParams(json_object=True)
        case "json_schema":
            return StructuredOutputsParams(json=closed_objects(json.loads(fmt.source)))
        case "regex":
            return StructuredOutputsParams(regex=fmt.source)
        case _:
            return StructuredOutputsParams(grammar=fmt.source)


def vllm_logprobs(position: dict[int, Any], token_id: int, top: int) -> TokenLogprob:
    """One generated position's logprobs from vLLM's ``{token id: Logprob}``: the chosen token's,
    and the ``top`` most likely by vLLM's rank."""
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None)
    alternatives = [(tid, float(logprob)) for rank, tid, logprob in ranked if rank <= top]
    return TokenLogprob(float(position[token_id].logprob), alternatives[:top])
