"""A real model: SmolLM2-135M-Instruct from the package registry, its BPE tokenizer and chat
template. Greedy output equals ``model.generate``; chat requests (from raw redis-cli too) are
answered; the streamed text equals the tokenizer's decode over random token sequences."""

import time

import pytest
from conftest import TEST_DEVICE, Reference, make_runner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.interface import TokenOutput
from tokenfleet.core.sequence import SeqState
from tokenfleet.core.vocab import render_chat
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys, Request

pytestmark = pytest.mark.integration

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 plus 2?", "Say hi."]


@pytest.fixture(scope="module")
def runner(smollm2):

    return make_runner(smollm2, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(num_blocks=256))


@pytest.fixture(scope="module")
def reference(smollm2):
    return Reference(smollm2)


def chat_ids(tokenizer, question):
    return render_chat(tokenizer, [{"role": "user", "content": question}])


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_greedy_equals_generate_on_smollm2_in_every_mode(runner, reference, mode):
    from test_engine import drain

    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=2 if mode == "static" else 4, max_seq_len=512, buckets=(128,), mode=mode
    )
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = []
    for i, question in enumerate(QUESTIONS):
        ids = chat_ids(runner.tokenizer, question)
        request = Request(id=f"q{i}", input_ids=tuple(ids), max_new_tokens=10, ignore_eos=True)
        seqs.append(SeqState(f"q{i}", request, ids, runner.tokenizer, runner.eos_token_ids, time.time()))
    for seq in drain(sched, {0: seqs[:2], 2: seqs[2:]}):
        assert seq.generated == reference.greedy(seq.prompt_ids, 10, ignore_eos=True), seq.request.id
    sched.check_idle()


def test_a_chat_from_raw_redis_cli_is_answered(runner, smollm2, redis_url, prefix, r):
    from conftest import RunningWorker

    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128))
    with RunningWorker(runner, redis_url, prefix, batching):
        # the plain form, as `redis-cli XADD '{P}:req:auto' '*' id ... messages '[...]'` writes it
        messages = '[{"role": "user", "content": "What is the capital of France?"}]'
        r.xadd(Keys(prefix).auto_stream, {"id": "chat-raw", "max_new_tokens": "24", "messages": messages})
        res = Client(redis_url, prefix=prefix).result("chat-raw", timeout=120)
        chat = Client(redis_url, prefix=prefix).chat(
            [{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=24
        )
        typed = chat.result(timeout=120)
    assert "Paris" in res.text and res.finish_reason == "stop"  # the end-of-turn token ended it
    assert typed.token_ids == res.token_ids
    assert res.token_ids[-1] in runner.eos_token_ids and res.usage["completion_tokens"] == len(res.token_ids)


# -- text: deltas over random token sequences equal the tokenizer's decode --------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def stream(tokenizer, ids, stop=()):
    request = Request(id="t", input_ids=(1,), max_new_tokens=len(ids) + 1, stop=tuple(stop), ignore_eos=True)
    seq = SeqState("t", request, [1], tokenizer, frozenset(), time.time())
    texts = []
    for token in ids:
        texts.append(TokenOutput.append(seq, token).text)
        if seq.finished:
            break
    if not seq.finished:  # the end of a request: what was held back goes out
        seq.finish_reason = "length"
        seq.text += seq.detok.flush()
        texts.append(seq.take_text_delta())
    return texts, seq


# text made of what the property must hold for: English, Chinese, emoji, code, and raw token ids
SAMPLES = [
    "The quick brown fox",
    "你好，世界！今天天气很好。",
    "emoji 👩‍💻🚀🎉 mix",
    "def f(x):\n    return x**2  # ok",
]


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_streamed_text_equals_the_decode_of_every_token(tokenizer, data):
    vocab = tokenizer.vocab_size
    if data.draw(st.booleans()):
        ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24))
    else:
        text = data.draw(st.sampled_from(SAMPLES))
        ids = tokenizer(text, add_special_tokens=False).input_ids
        cut = data.draw(st.integers(1, len(ids)))
        ids = ids[:cut]
    texts, seq = stream(tokenizer, ids)
    assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in t or "\ufffd" in tokenizer.decode(ids) for t in texts)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_a_stop_string_spanning_tokens_is_never_streamed(tokenizer, sample, data):
    ids = tokenizer(sample, add_special_tokens=False).input_ids
    full = tokenizer.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, len(full) - 2))
    stop = full[start : start + data.draw(st.integers(2, min(8, len(full) - start)))]
    texts, seq = stream(tokenizer, ids, stop=[stop])
    streamed = "".join(texts)
    assert streamed == full[: full.index(stop)]
    assert seq.finish_reason == "stop" and stop not in streamed


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_kill_9_mid_chat_another_worker_resumes_on_smollm2(
    runner, reference, smollm2, redis_url, prefix, r, tmp_path
):
    """float32 workers: the resumed greedy continuation equals an uncrashed run's."""
    import signal
    import subprocess

    from conftest import RunningWorker, worker_process

    keys, new = Keys(prefix), 48
    flags = ["--buckets", "64,128", "--max-wait-ms", "20", "--claim-idle-ms", "1000", "--max-seq-len", "512"]
    log = open(tmp_path / "w.log", "w")  # noqa: SIM115 (closed below)
    first = worker_process(smollm2, redis_url, prefix, *flags, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = Client(redis_url, model=smollm2, prefix=prefix, buckets=[64, 128])
        prompts = [chat_ids(runner.tokenizer, q) for q in QUESTIONS[:3]]
        handles = [client.submit(input_ids=ids, max_new_tokens=new, ignore_eos=True) for ids in prompts]
        deadline = time.monotonic() + 180
        while not all(r.xlen(keys.reply_stream(h.id)) >= 4 for h in handles):
            assert time.monotonic() < deadline and first.poll() is None, "the first worker never streamed"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert all(r.xlen(keys.reply_stream(h.id)) < new for h in handles)
        batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128))
        with RunningWorker(runner, redis_url, prefix, batching, claim_idle_ms=1000) as second:
            results = [h.result(timeout=300) for h in handles]
            assert second.worker.reclaimed == len(handles)
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    for ids, res in zip(prompts, results):
        assert res.token_ids == reference.greedy(ids, new, ignore_eos=True)


def test_greedy_equals_generate_on_smollm2_with_preemption(smollm2, reference):
    from test_engine import drain

    # 24 blocks of 4 tokens: two ~36-token chats fit (10 blocks each), then both grow by 6 blocks
    small = make_runner(
        smollm2, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=24)
    )
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(64,), mode="continuous"
    )
    sched = NativeCore(small, cfg, clock=lambda: 1e9)
    seqs = []
    for i, question in enumerate(QUESTIONS):
        ids = chat_ids(small.tokenizer, question)
        request = Request(id=f"p{i}", input_ids=tuple(ids), max_new_tokens=24, ignore_eos=True)
        seqs.append(SeqState(f"p{i}", request, ids, small.tokenizer, small.eos_token_ids, time.time()))
    for seq in drain(sched, {0: seqs}):
        assert seq.generated == reference.greedy(seq.prompt_ids, 24, ignore_eos=True), seq.request.id
    assert sched.scheduler.preemptions > 0, "the pool was never short: the test proves nothing"
    sched.check_idle()


def test_the_openai_client_chats_with_smollm2_through_the_gateway(runner, smollm2, redis_url, prefix):
    """Chat completions through `tokenfleet serve` with the real openai package: the model's chat
    template, its end-of-turn token, the role in the first delta, and the Python client's tokens."""
    from conftest import RunningWorker
    from gateway_process import Gateway

    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with RunningWorker(runner, redis_url, prefix, batching, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2)
        try:
            client = gateway.openai()
            asked = {"model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0}
            whole = client.chat.completions.create(**asked)
            answer = whole.choices[0]
            assert "Paris" in answer.message.content and answer.finish_reason == "stop"
            assert answer.message.role == "assistant" and whole.object == "chat.completion"
            chunks = list(client.chat.completions.create(**asked, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.message.content
            direct = Client(redis_url, prefix=prefix).chat(messages, max_new_tokens=24).result(timeout=120)
            assert answer.token_ids == direct.token_ids
        finally:
            gateway.stop()
