"""With the README's flags alone (``--model`` and ``--dtype``: no bucket or length flags) a worker
serves what its model's context allows: a 1,000-token chat and a 4,000-token prompt, through the
Python client and through the gateway."""

import subprocess
import time
from pathlib import Path

import pytest
import redis
from conftest import worker_process
from gateway_process import Gateway

from tokenfleet.producer import Client
from tokenfleet.protocol import Keys

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PARAGRAPH = (
    "Redis streams carry prompts from producers in any language to a fleet of workers, which batch "
    "them by length, run them on a paged key-value cache and stream every token back. "
)


def text_of(tokenizer, tokens: int) -> str:
    """Text of about ``tokens`` tokens (never more)."""
    text = ""
    while len(tokenizer.encode(text + PARAGRAPH).ids) <= tokens:
        text += PARAGRAPH
    return text


def test_a_long_chat_and_a_long_prompt_are_served_with_the_readme_flags(smollm2, redis_url, prefix, tmp_path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(smollm2) / "tokenizer.json"))
    chat = [
        {"role": "system", "content": text_of(tokenizer, 1000)},
        {"role": "user", "content": "In one sentence: what carries the prompts?"},
    ]
    long_prompt = text_of(tokenizer, 4000)
    log = open(tmp_path / "worker.log", "w+")  # noqa: SIM115 (closed below)
    worker = worker_process(smollm2, redis_url, prefix, stdout=log, stderr=subprocess.STDOUT)
    gateway = None
    try:
        admin = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 180
        while not admin.hlen(Keys(prefix).workers):
            assert worker.poll() is None and time.monotonic() < deadline, (
                tmp_path / "worker.log"
            ).read_text()
            time.sleep(0.2)
        assert "serving buckets 128,512,2048,8192, max_seq_len 8192" in (tmp_path / "worker.log").read_text()
        client = Client(redis_url, model=smollm2, prefix=prefix)
        answered = client.chat(chat, max_new_tokens=8).result(timeout=300)
        assert answered.usage["prompt_tokens"] > 1000 and answered.token_ids
        long = client.submit(long_prompt, max_new_tokens=8).result(timeout=300)
        assert long.usage["prompt_tokens"] >= 3900 and len(long.token_ids) == 8

        gateway = Gateway(redis_url, prefix, smollm2)
        openai = gateway.openai(timeout=300)
        model = Path(smollm2).name
        reply = openai.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0)
        assert reply.usage.prompt_tokens > 1000 and reply.choices[0].message.content
        completion = openai.completions.create(model=model, prompt=long_prompt, max_tokens=8, temperature=0)
        assert completion.usage.prompt_tokens >= 3900 and completion.choices[0].text
    finally:
        if gateway is not None:
            gateway.stop()
        worker.terminate()
        worker.wait(60)
        log.close()
