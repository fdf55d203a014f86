"""What a request asks to change in its logits before a token is chosen, and the logprobs it
asks to see after: vectorised over the batch's rows that ask, in vLLM's order (``logit_bias``,
``min_tokens``, the repetition penalty over prompt and output, the frequency and presence
penalties over the output, the grammar's mask). Rows that ask for nothing are not touched.

The penalties follow their owners' definitions: ``repetition_penalty`` is Hugging Face's (a
positive logit divided by it, a negative one multiplied), ``frequency_penalty`` and
``presence_penalty`` OpenAI's (minus ``count x frequency + (count > 0) x presence``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.kernels.loader import kernels_loaded
from tokenfleet.engines.native.sampling.draw import choose_tokens
from tokenfleet.engines.native.sampling.grammar_masks import GrammarMasks, PendingMasks, RowMasks
from tokenfleet.engines.native.types import Chosen
from tokenfleet.protocol import TokenLogprob

NO_ALLOWED_TOKEN = "the response_format allows no token here (the grammar is at a dead end)"


def choose_controlled(
    logits: torch.Tensor, seqs: list[SeqState], grammar: GrammarMasks, pending: PendingMasks | None
) -> Chosen:
    """Each row's token after its logit processing (None for a row that could not be sampled or
    has no allowed token, its ``sampling_error`` saying why), and the logprobs asked for.
    ``pending``: the masks ``grammar`` began filling for the rows that need theirs first; the other
    constrained rows are checked after drawing (see :class:`GrammarMasks`)."""
    masks = grammar.collect(pending)
    dead = process_logits(logits, seqs, masks)
    tokens = choose_tokens(logits, seqs)
    late = grammar.refused(seqs, tokens, masks)
    if late is not None:
        dead += _redraw(logits, seqs, tokens, late)
    for row in dead:
        seqs[row].sampling_error = NO_ALLOWED_TOKEN
        tokens[row] = None
    return Chosen(tokens, token_logprobs(logits, seqs, tokens))


def process_logits(logits: torch.Tensor, seqs: Sequence[SeqState], masks: RowMasks | None) -> list[int]:
    """Apply each row's penalties, bias, ``min_tokens`` and grammar mask to ``logits`` ``[B,
    vocab]`` in place; returns the rows left with no allowed token (each fails alone)."""
    rows = [i for i, seq in enumerate(seqs) if seq.request.adjusts_logits]
    if rows:
        whole = len(rows) == len(seqs)  # work on the logits themselves where every row asks
        sub = logits if whole else logits.index_select(0, torch.tensor(rows))
        picked = [seqs[i] for i in rows]
        _bias(sub, picked)
        _hold_back_ends(sub, picked)
        _penalise(sub, picked)
        if not whole:
            logits.index_copy_(0, torch.tensor(rows), sub)
    return forbid(logits, masks) if masks is not None and masks.rows else []


def _redraw(
    logits: torch.Tensor, seqs: list[SeqState], tokens: list[int | None], late: RowMasks
) -> list[int]:
    """Mask the rows ``late.rows`` (their grammar refused the token drawn without a mask) and draw
    each again from a number independent of the first; returns those left with no allowed token."""
    dead = forbid(logits, late)
    masked = logits.index_select(0, torch.tensor(late.rows))
    for row, token in zip(late.rows, choose_tokens(masked, [seqs[r] for r in late.rows], redraw=True)):
        tokens[row] = token
    return dead


def forbid(logits: torch.Tensor, masks: RowMasks) -> list[int]:
    """-inf wherever a row's grammar forbids the token (the rows ``masks.rows`` of ``logits``, in
    place); returns the rows left with no token above -inf. One pass a row in the CPU kernel."""
    at = torch.tensor(masks.rows)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and kernels_loaded():
        some_left = torch.ops.tokenfleet.apply_token_bitmask_(logits, at, masks.bits).tolist()
    else:
        blocked = masks.blocked(logits.shape[1]).to(logits.device)
        at = at.to(logits.device)
        masked = logits.index_select(0, at).masked_fill_(blocked, float("-inf"))
        logits.index_copy_(0, at, masked)
        some_left = (~torch.isneginf(masked.max(dim=-1).values)).tolist()
    return [row for row, left in zip(masks.rows, some_left) if not left]


def _bias(sub: torch.Tensor, seqs: list[SeqState]) -> None:
    at = [(r, token, bias) for r, seq in enumerate(seqs) for token, bias in seq.request.logit_bias]
    if at:
        rows, tokens, biases = zip(*at)
        sub.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(biases), accumulate=True)


def _hold_back_ends(sub: torch.Tensor, seqs: list[SeqState]) -> None:
    """No EOS (unless ignored) and no stop token id before ``min_tokens`` tokens."""
    at = []
    for r, seq in enumerate(seqs):
        req = seq.request
        if len(seq.generated) < req.min_tokens:
            ends = set(req.stop_token_ids) | (set() if req.ignore_eos else set(seq.eos_ids))
            at += [(r, token) for token in ends if token < sub.shape[1]]
    if at:
        rows, tokens = zip(*at)
        sub[torch.tensor(rows), torch.tensor(tokens)] = float("-inf")


def _penalise(sub: torch.Tensor, seqs: list[SeqState]) -> None:
    vocab = sub.shape[1]
    repetition = [seq.request.repetition_penalty for seq in seqs]
    if any(p != 1.0 for p in repetition):
        seen = _counts([seq.prompt_ids + seq.generated for seq in seqs], vocab) > 0
        factor = torch.tensor(repetition)[:, None]
        penalised = torch.where(sub > 0, sub / factor, sub * factor)
        sub.copy_(torch.where(seen, penalised, sub))
    frequency = [seq.request.frequency_penalty for seq in seqs]
    presence = [seq.request.presence_penalty for seq in seqs]
    if any(frequency) or any(presence):
        counts = _counts([seq.generated for seq in seqs], vocab)
        sub -= torch.tensor(frequency)[:, None] * counts + torch.tensor(presence)[:, None] * (counts > 0)


def _counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """How often each token occurs in each row's list, ``[rows, vocab]`` float32."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # column ``vocab``: padding
    for r, tokens in enumerate(token_lists):
        if tokens:
            ids[r, : len(tokens)] = torch.tensor(tokens)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def token_logprobs(
    logits: torch.Tensor, seqs: Sequence[SeqState], tokens: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """For each row whose request asks for logprobs: the chosen token's log probability and the
    ``logprobs`` most likely tokens, from the distribution it was drawn from (the processed
    logits at its temperature; a greedy row's at 1), before top-k and top-p cut it."""
    out: list[TokenLogprob | None] = [None] * len(seqs)
    rows = [i for i, seq in enumerate(seqs) if seq.request.logprobs is not None and tokens[i] is not None]
    if not rows:
        return out
    temperature = torch.tensor([seqs[i].request.temperature or 1.0 for i in rows], dtype=torch.float64)
    scaled = logits.index_select(0, torch.tensor(rows)).double() / temperature[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows])).squeeze(1).tolist()
    k = max(seqs[i].request.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for n, row in enumerate(rows):
        want = seqs[row].request.logprobs or 0
        top = [
            (token, value)
            for token, value in zip(top_ids[n, :want].tolist(), top_values[n, :want].tolist())
            if value != float("-inf")  # a token the grammar forbids is no alternative
        ]
        out[row] = TokenLogprob(chosen[n], top)
    return out
