"""Logprobs, penalties, ``logit_bias`` and ``min_tokens`` in the native engine, against Hugging
Face's own logits processors and ``log_softmax`` of its float32 logits on the same inputs."""

import statistics
import time

import pytest
import torch
from conftest import TEST_DEVICE
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.engines.native.sampling.logits_process import process_logits, token_logprobs
from tokenfleet.protocol import Request

PROMPTS = ["The capital of France is", "One, two, three,", "hello hello hello", "a b c d e f g"]


def seq_of(runner, i, prompt_ids, **params):
    request = Request(id=f"r{i}", input_ids=tuple(prompt_ids), **params)
    return SeqState(f"r{i}", request, list(prompt_ids), runner.tokenizer, runner.eos_token_ids, time.time())


def run(runner, seqs):
    """Run ``seqs`` to the end in one core; returns each one's logprobs, by request id."""
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=8, max_seq_len=256, buckets=(32,), mode="continuous"
    )
    core = NativeCore(runner, cfg, clock=lambda: 1e9)
    logprobs: dict[str, list] = {}
    for seq in seqs:
        assert core.add(seq, 0.0) is None
    for _ in range(500):
        output = core.step()
        assert not output.failed
        for out in output.tokens:
            logprobs.setdefault(out.seq.request.id, []).append(out.logprob)
        if all(seq.finished for seq in seqs):
            break
    assert all(seq.finished for seq in seqs)
    core.check_idle()
    return logprobs


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties, written from their definition, per row."""

    def __init__(self, prompt_len, frequency, presence):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token in set(input_ids[0, self.prompt_len :].tolist()):
            count = input_ids[0, self.prompt_len :].tolist().count(token)
            scores[0, token] -= count * self.frequency + self.presence
        return scores


def hf_generate(reference, prompt_ids, max_new_tokens, processors=(), **kwargs):
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt_ids], device=TEST_DEVICE)
    with torch.inference_mode():
        out = reference.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            min_new_tokens=max_new_tokens,
            logits_processor=LogitsProcessorList(processors),
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_logprobs_equal_log_softmax_of_hf_float32_logits(runner, reference):
    seqs = [
        seq_of(runner, i, reference.ids(p), max_new_tokens=6, ignore_eos=True, logprobs=5)
        for i, p in enumerate(PROMPTS)
    ]
    plain = seq_of(runner, 9, reference.ids(PROMPTS[0]), max_new_tokens=6, ignore_eos=True)
    logprobs = run(runner, [*seqs, plain])
    assert set(logprobs["r9"]) == {None}  # a row that did not ask gets none
    for seq in seqs:
        full = torch.tensor([seq.prompt_ids + seq.generated], device=TEST_DEVICE)
        with torch.inference_mode():
            logits = reference.model(full).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(seq.prompt_ids) - 1 : -1]
        assert len(seq.generated) == 6
        lps = logprobs[seq.request.id]
        for pos, (token, lp) in enumerate(zip(seq.generated, lps)):
            assert lp.logprob == pytest.approx(expected[pos, token].item(), abs=1e-4)
            top_values, top_ids = expected[pos].topk(5)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert seqs[0].generated == plain.generated  # asking for logprobs changes no token


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_hf_generate(runner, reference, penalty):
    prompts = [reference.ids(p) for p in PROMPTS]
    seqs = [
        seq_of(runner, i, ids, max_new_tokens=12, ignore_eos=True, repetition_penalty=penalty)
        for i, ids in enumerate(prompts)
    ]
    run(runner, seqs)
    for seq, ids in zip(seqs, prompts):
        assert seq.generated == hf_generate(reference, ids, 12, repetition_penalty=penalty)
    plain = [reference.greedy(ids, 12, ignore_eos=True) for ids in prompts]
    assert [s.generated for s in seqs] != plain, "the penalty changed nothing: the test proves nothing"


def test_frequency_and_presence_penalties_and_bias_equal_hf_with_their_processors(runner, reference):
    prompts = [reference.ids(p) for p in PROMPTS]
    bias = {int(prompts[0][-1]): 5.0, 7: -100.0}
    cases = [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=0.5, presence_penalty=-1.0, logit_bias=tuple(sorted(bias.items()))),
        dict(),  # an unprocessed row beside processed ones
    ]
    seqs = [
        seq_of(runner, i, ids, max_new_tokens=10, ignore_eos=True, **case)
        for i, (ids, case) in enumerate(zip(prompts, cases))
    ]
    run(runner, seqs)
    for seq, ids, case in zip(seqs, prompts, cases):
        processors = [
            OpenAIPenalties(len(ids), case.get("frequency_penalty", 0.0), case.get("presence_penalty", 0.0))
        ]
        if "logit_bias" in case:
            processors.insert(0, SequenceBiasLogitsProcessor({(t,): b for t, b in case["logit_bias"]}))
        assert seq.generated == hf_generate(reference, ids, 10, processors), case


def test_processing_equals_hf_processors_on_the_same_logits(runner):
    torch.manual_seed(0)
    vocab = runner.vocab_size
    logits = torch.randn(3, vocab) * 4
    prompt = [5, 9, 9, 40]
    rows = [
        seq_of(runner, 0, prompt, repetition_penalty=1.7, max_new_tokens=8),
        seq_of(runner, 1, prompt, min_tokens=4, max_new_tokens=8, stop_token_ids=(11,)),
        seq_of(runner, 2, prompt, logit_bias=((3, 2.5), (4, -7.0)), max_new_tokens=8),
    ]
    for seq in rows:
        seq.generated = [9, 12, 12]
    ours = logits.clone()
    assert process_logits(ours, rows, None) == []
    history = torch.tensor([prompt + [9, 12, 12]])
    eos = sorted(runner.eos_token_ids)
    expected = [
        RepetitionPenaltyLogitsProcessor(1.7)(history, logits[0:1].clone()),
        MinNewTokensLengthLogitsProcessor(len(prompt), 4, eos + [11])(history, logits[1:2].clone()),
        SequenceBiasLogitsProcessor({(3,): 2.5, (4,): -7.0})(history, logits[2:3].clone()),
    ]
    for row, want in enumerate(expected):
        assert torch.equal(ours[row : row + 1], want), row
    rows[1].generated = [1, 2, 3, 4]  # min_tokens reached: EOS allowed again
    again = logits.clone()
    process_logits(again, rows, None)
    assert torch.equal(again[1], logits[1])


def test_min_tokens_holds_back_eos_until_reached(runner, reference):
    ids = reference.ids(PROMPTS[1])
    first = reference.greedy(ids, 1)[0]  # the token greedy picks first: call it the end
    seq = seq_of(runner, 0, ids, max_new_tokens=8, min_tokens=3, stop_token_ids=(first,))
    run(runner, [seq])
    assert len(seq.generated) >= 3 and first not in seq.generated[:3]


def test_logprobs_of_a_sampled_row_come_from_its_tempered_distribution(runner):
    logits = torch.randn(2, runner.vocab_size)
    seqs = [seq_of(runner, i, [1, 2], logprobs=2, temperature=t) for i, t in enumerate((0.5, 0.0))]
    out = token_logprobs(logits, seqs, [3, 4])
    tempered = torch.log_softmax(logits[0].double() / 0.5, -1)
    assert out[0].logprob == pytest.approx(tempered[3].item())
    assert out[1].logprob == pytest.approx(torch.log_softmax(logits[1].double(), -1)[4].item())
    assert [t for t, _ in out[0].top] == tempered.topk(2).indices.tolist()


def test_object_schemas_that_list_their_properties_take_no_others():
    from tokenfleet.protocol.output_controls import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},  # a field so named
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"b": {}}}},
        },
        "$defs": {"Inner": {"anyOf": [{"properties": {"c": {}}}, {"type": "null"}]}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    inner = closed["properties"]
    assert inner["properties"]["additionalProperties"] is False and "additionalProperties" not in inner
    assert inner["open"]["additionalProperties"] is True
    assert inner["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["Inner"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


@pytest.mark.parametrize("vocab", [64, 70, 100])
def test_grammar_masks_unpack_bit_for_bit_and_forbid_tokens_past_the_bitmask(vocab):
    from tokenfleet.engines.native.sampling.grammar_masks import RowMasks

    bits = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32)  # 96 tokens' bits
    blocked = RowMasks([0, 1, 2], bits, 0.0).blocked(vocab)
    expected = [
        [not (int(bits[r, t // 32]) >> (t % 32)) & 1 if t < 96 else True for t in range(vocab)]
        for r in range(3)
    ]
    assert blocked.tolist() == expected


@pytest.mark.parametrize("vocab", [64, 70, 100, 1000])
def test_the_mask_kernel_forbids_what_the_bits_forbid_in_place_and_finds_rows_left_empty(kernels, vocab):
    from tokenfleet.engines.native.sampling.grammar_masks import RowMasks
    from tokenfleet.engines.native.sampling.logits_process import forbid

    torch.manual_seed(vocab)
    words = 3 if vocab < 1000 else 32  # 96 tokens' bits: 64 and 70 past the vocabulary, 100 short
    bits = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32)
    bits[1] = 0  # nothing allowed: row 3 is left empty
    bits[2, 0] = 1 << 7  # only token 7 among the first 32, and row 4 holds -inf there
    logits = torch.randn(6, vocab)
    logits[4, 7] = float("-inf")
    rows = [1, 3, 4, 5]
    masks = RowMasks(rows, bits, 0.0)
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(masks.blocked(vocab), float("-inf"))
    ours = logits.clone()
    dead = forbid(ours, masks)
    assert torch.equal(ours, expected)  # rows 0 and 2 untouched; the others exactly as unpacked
    left = ~torch.isneginf(expected[rows].max(dim=-1).values)
    assert dead == [row for row, any_left in zip(rows, left.tolist()) if not any_left]
    assert 3 in dead


def test_a_plain_row_a_biased_row_and_a_constrained_row_are_each_processed_alone(runner):
    from tokenfleet.engines.native.sampling.grammar_masks import RowMasks
    from tokenfleet.protocol.output_controls import parse_response_format

    torch.manual_seed(0)
    vocab = runner.vocab_size
    logits = torch.randn(3, vocab)
    rows = [
        seq_of(runner, 0, [5, 9], max_new_tokens=8),
        seq_of(runner, 1, [5, 9], logit_bias=((3, 2.5),), max_new_tokens=8),
        seq_of(
            runner,
            2,
            [5, 9],
            response_format=parse_response_format({"type": "json_object"}),
            max_new_tokens=8,
        ),
    ]
    bits = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bits[0, 0] = (1 << 5) | (1 << 6)  # the grammar allows tokens 5 and 6 only
    ours = logits.clone()
    assert process_logits(ours, rows, RowMasks([2], bits, 0.0)) == []
    assert torch.equal(ours[0], logits[0])
    biased = logits[1].clone()
    biased[3] += 2.5
    assert torch.equal(ours[1], biased)
    assert torch.isfinite(ours[2]).nonzero().flatten().tolist() == [5, 6]
    assert torch.equal(ours[2, 5:7], logits[2, 5:7])


def test_grammar_masks_first_where_the_draw_needs_them_and_after_a_refused_draw(runner):
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    from tokenfleet.engines.native.sampling.grammar_masks import GrammarMasks
    from tokenfleet.protocol.output_controls import parse_response_format

    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=8, max_seq_len=256, buckets=(32,))
    grammars = NativeCore(runner, cfg).grammars
    free = parse_response_format({"type": "regex", "regex": "(yes|no)!"})
    forced = parse_response_format({"type": "regex", "regex": "maybe (yes|no)!"})
    seqs = [
        seq_of(runner, 0, [5, 9], max_new_tokens=8),  # unconstrained
        seq_of(runner, 1, [5, 9], response_format=free, max_new_tokens=8),  # greedy: checked after
        seq_of(runner, 2, [5, 9], response_format=free, logprobs=2, max_new_tokens=8),  # masked first
        seq_of(runner, 3, [5, 9], response_format=forced, max_new_tokens=8),  # forced bytes: first
    ]
    for seq in seqs[1:]:
        seq.matcher = grammars.matcher(seq.request.response_format)

    def alone(fmt):
        bits = allocate_token_bitmask(1, runner.vocab_size)
        fill_next_token_bitmask(grammars.matcher(fmt), bits, 0)
        return bits[0]

    masks = GrammarMasks(runner.vocab_size)
    first = masks.collect(masks.start(seqs))
    assert first is not None and first.rows == [2, 3]
    assert torch.equal(first.bits[0], alone(free)) and torch.equal(first.bits[1], alone(forced))
    allowed = runner.tokenizer.encode("yes", add_special_tokens=False)[0]
    assert masks.refused(seqs, [7, allowed, 1, 1], first) is None  # the check lets "yes" through
    refused = runner.tokenizer.encode("x", add_special_tokens=False)[0]
    late = masks.refused(seqs, [7, refused, 1, 1], first)
    assert late is not None and late.rows == [1] and torch.equal(late.bits[0], alone(free))
    # Linux tells each thread's CPU time: llguidance's threads are found and their work counted
    assert len(masks.cpu_s) == 2 and min(masks.cpu_s) > 0
    assert list(masks.masked) == [2 / 3, 1.0]


def test_a_sampled_row_drawn_before_its_mask_follows_the_masked_distribution(runner):
    """Kept where the grammar allows the draw, drawn again from the masked distribution where it
    refuses it: the tokens' frequencies are the masked distribution's (exact, so 4,000 seeded draws
    land within sampling noise of it)."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    from tokenfleet.engines.native.sampling.grammar_masks import GrammarMasks, RowMasks
    from tokenfleet.engines.native.sampling.logits_process import choose_controlled
    from tokenfleet.protocol.output_controls import parse_response_format

    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=8, max_seq_len=256, buckets=(32,))
    grammars = NativeCore(runner, cfg).grammars
    fmt = parse_response_format({"type": "regex", "regex": "(yes|no|maybe|never)!"})
    bits = allocate_token_bitmask(1, runner.vocab_size)
    fill_next_token_bitmask(grammars.matcher(fmt), bits, 0)
    allowed = ~RowMasks([0], bits, 0.0).blocked(runner.vocab_size)[0]
    torch.manual_seed(1)
    logits = torch.randn(runner.vocab_size)
    logits[allowed] += logits[~allowed].logsumexp(0) - logits[allowed].logsumexp(0)  # half the mass each
    masked = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    grammar, counts, n = GrammarMasks(runner.vocab_size), torch.zeros(runner.vocab_size), 4000
    for seed in range(n):
        seq = seq_of(runner, seed, [5, 9], response_format=fmt, temperature=1.0, seed=seed, max_new_tokens=4)
        seq.matcher = grammars.matcher(fmt)
        chosen = choose_controlled(logits[None].clone(), [seq], grammar, grammar.start([seq]))
        counts[chosen.tokens[0]] += 1
    assert counts[~allowed].sum() == 0
    assert 0.1 < statistics.fmean(grammar.masked) < 0.9  # some draws kept, some drawn again
    total_variation = (counts / n - masked).abs().sum() / 2
    assert total_variation < 0.05, total_variation
