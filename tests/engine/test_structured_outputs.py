"""Structured outputs in the engine core, in-process on a real model (SmolLM2): constrained greedy
decoding equals ``model.generate`` under llguidance's full mask, whether a row is drawn before its
mask (and checked after) or masked first."""

import pytest
from conftest import make_runner
from structured_cases import QUESTIONS, SCHEMAS, chat_ids

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runner(smollm2):

    return make_runner(smollm2, device="cpu", dtype="float32", kv=KVCacheConfig(num_blocks=1024))


def test_constrained_greedy_equals_generate_with_the_full_mask_whichever_way_it_is_masked(runner, smollm2):
    """Rows drawn before their mask (greedy, checked after) and rows masked first (logprobs) both
    give exactly ``model.generate``'s tokens under llguidance's full mask at every step."""
    import time

    import llguidance
    import torch
    from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from tokenfleet.core.offline import run_offline
    from tokenfleet.core.sequence import SeqState
    from tokenfleet.engines.native.core import NativeCore
    from tokenfleet.protocol import Request
    from tokenfleet.protocol.output_controls import parse_response_format

    class FullMask(LogitsProcessor):
        def __init__(self, matcher: llguidance.LLMatcher, prompt_len: int):
            self.matcher, self.prompt_len, self.fed = matcher, prompt_len, 0

        def __call__(self, input_ids, scores):
            for token in input_ids[0, self.prompt_len + self.fed :].tolist():
                assert self.matcher.consume_token(token)
                self.fed += 1
            bits = allocate_token_bitmask(1, scores.shape[1])
            fill_next_token_bitmask(self.matcher, bits, 0)
            apply_token_bitmask_inplace(scores, bits)
            return scores

    batching = DynamicBatchingConfig(
        mode="continuous", max_wait_ms=0, max_batch_size=8, max_seq_len=512, buckets=(128,)
    )
    core = NativeCore(runner, batching)
    model = AutoModelForCausalLM.from_pretrained(smollm2, torch_dtype=torch.float32).eval()
    cases = [(SCHEMAS[n], QUESTIONS[n]) for n in (0, 3, 6)]  # maxLength strings, a pattern, arrays
    seqs, expected = [], []
    for n, (schema, question) in enumerate(cases):
        fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        ids = chat_ids(runner.tokenizer, question)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                logits_processor=LogitsProcessorList([FullMask(core.grammars.matcher(fmt), len(ids))]),
            )
        expected.append([t for t in out[0, len(ids) :].tolist() if t not in runner.eos_token_ids])
        for first in (False, True):
            request = Request(
                id=f"r{n}{first}", input_ids=tuple(ids), max_new_tokens=32, response_format=fmt,
                logprobs=0 if first else None,
            )  # fmt: skip
            matcher = core.output_constraint(request)
            tok, eos = runner.tokenizer, runner.eos_token_ids
            seqs.append(SeqState(request.id, request, list(ids), tok, eos, time.time(), matcher=matcher))
    assert not run_offline(core, [(0.0, seq) for seq in seqs]).failed
    for n, want in enumerate(expected):
        assert [list(seqs[2 * n].generated), list(seqs[2 * n + 1].generated)] == [want, want]
    masks = runner.grammar_masks
    assert min(masks.masked) < 1 and max(masks.masked) == 1  # rows drawn unmasked, some refused and redrawn
