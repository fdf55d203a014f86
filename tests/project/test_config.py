"""Configuration from one source: every default on its field, the CLI generated from the fields,
layering in the config package."""

import dataclasses

import pytest
from click.testing import CliRunner

from tokenfleet.cli import main
from tokenfleet.config import (
    WORKER_SETTINGS,
    DynamicBatchingConfig,
    EngineConfig,
    WorkerConfig,
    flatten,
    resolve_worker_config,
    worker_config,
)


def test_every_setting_is_a_flag_of_the_worker_with_its_default_in_the_help():
    out = CliRunner().invoke(main, ["worker", "--help"])
    assert out.exit_code == 0
    text = " ".join(out.output.split())  # help wraps lines anywhere
    flat = flatten(WorkerConfig())
    for spec in WORKER_SETTINGS:
        assert spec.flag in text, spec.name
        if flat[spec.name] is not None and spec.setting.kind != "bool":
            shown = (
                ",".join(map(str, flat[spec.name])) if isinstance(flat[spec.name], list) else flat[spec.name]
            )
            assert f"[default: {spec.setting.default_text or shown}]" in text, spec.name


def test_without_bucket_flags_a_worker_serves_the_models_whole_context(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 8192}')
    fitted = resolve_worker_config({"model": str(model)}, environ={}).batching
    assert (fitted.max_seq_len, fitted.buckets) == (8192, (128, 512, 2048, 8192))
    capped = resolve_worker_config({"model": str(model), "max_seq_len": 4096}, environ={}).batching
    assert (capped.max_seq_len, capped.buckets) == (4096, (128, 512, 2048, 4096))
    named = resolve_worker_config({"model": str(model), "buckets": "64,256"}, environ={}).batching
    assert (named.max_seq_len, named.buckets) == (8192, (64, 256))
    online = resolve_worker_config({"model": str(model)}, environ={}, profile="online").batching
    assert (online.max_seq_len, online.buckets) == (4096, (128, 512, 2048, 4096))
    (model / "config.json").write_text('{"text_config": {"max_position_embeddings": 300}}')
    nested = resolve_worker_config({"model": str(model)}, environ={}).batching
    assert (nested.max_seq_len, nested.buckets) == (300, (128, 300))
    (model / "config.json").write_text("{}")  # the model does not say: the fields' defaults
    assert resolve_worker_config({"model": str(model)}, environ={}).batching == DynamicBatchingConfig()


def test_flag_names_are_unique_across_sections():
    names = [spec.name for spec in WORKER_SETTINGS]
    assert len(names) == len(set(names))


def test_nothing_given_means_the_fields_defaults():
    assert resolve_worker_config({}, environ={}) == WorkerConfig()


def test_environment_values_are_parsed_by_the_fields_kind():
    config = resolve_worker_config(
        {},
        environ={
            "TOKENFLEET_PAGED_KERNEL": "0",
            "TOKENFLEET_BF16_LINEAR": "float32",
            "TOKENFLEET_KV_CACHE_MEMORY": "2GiB",
            "TOKENFLEET_BUCKETS": "64,32",
            "REDIS_URL": "redis://elsewhere:6379/1",
        },
    )
    assert config.engine.paged_kernel is False and config.engine.bf16_linear == "float32"
    assert config.kv.memory_bytes == 2 << 30
    assert config.batching.buckets == (32, 64)
    assert config.redis.url == "redis://elsewhere:6379/1"
    with pytest.raises(ValueError, match="paged_kernel from TOKENFLEET_PAGED_KERNEL"):
        resolve_worker_config({}, environ={"TOKENFLEET_PAGED_KERNEL": "maybe"})
    with pytest.raises(ValueError, match="bf16_linear"):
        resolve_worker_config({}, environ={"TOKENFLEET_BF16_LINEAR": "fp32"})


def test_worker_config_takes_settings_by_flag_name():
    config = worker_config(model="/m", max_wait_ms=5, claim_idle_ms=500, stream_interval_ms=10)
    assert config.engine == EngineConfig(model="/m")
    assert config.batching == DynamicBatchingConfig(max_wait_ms=5.0)
    assert (config.reliability.claim_idle_ms, config.streaming.stream_interval_ms) == (500, 10.0)
    with pytest.raises(ValueError, match="unknown settings: max_wiat_ms"):
        worker_config(max_wiat_ms=5)


def test_sections_refuse_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="max_batch_size"):
        DynamicBatchingConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="overlap_io"):
        worker_config(overlap_io="sometimes")
    with pytest.raises(ValueError, match="claim_idle_ms"):
        worker_config(claim_idle_ms=5)
    assert dataclasses.replace(WorkerConfig(), name="w1").name == "w1"


def test_adapter_slots_default_to_none_on_vllm_unless_adapters_are_named():
    """vLLM's LoRA layers slow every request (0.44x on CPU with no adapter named): its workers turn
    them on only for --lora or an explicit --max-loras; the native engine's cost nothing unused."""
    from tokenfleet.engines.vllm.args import lora_args

    assert EngineConfig().lora_slots("native") == 4 and EngineConfig().lora_slots("vllm") == 0
    named = EngineConfig(lora=(("support", "/adapters/support"),))
    assert named.lora_slots("vllm") == 4
    assert (
        EngineConfig(max_loras=2).lora_slots("vllm") == 2
        and EngineConfig(max_loras=0).lora_slots("native") == 0
    )
    assert lora_args(WorkerConfig(EngineConfig())) == {}
    assert lora_args(WorkerConfig(named))["max_loras"] == 4
