"""A worker's configuration as vLLM's ``EngineArgs``: one mapping, documented in docs/operations/engines.md"""

from __future__ import annotations

from typing import Any

from tokenfleet.config import WorkerConfig

# With no KV budget given, vLLM on the CPU would take 0.92 of the machine's memory, which fails
# wherever anything else runs; half of it, as the benches' default row does
CPU_MEMORY_UTILIZATION = 0.5


def engine_args(config: WorkerConfig) -> Any:
    """``EngineArgs`` for ``config``: the model and dtype, ``max_seq_len`` as ``max_model_len``,
    ``max_batch_size`` as ``max_num_seqs``, ``--num-blocks`` / ``--kv-cache-memory`` as the KV
    cache's size; vLLM's own block size (its CPU attention needs multiples of 32). Token ids go
    in and come out: tokenfleet tokenizes and detokenizes (vLLM's tokenizer serves its grammars)."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import EngineArgs

    from tokenfleet.engines.native.device import select_device, select_dtype

    device = select_device(config.engine.device)
    dtype = str(select_dtype(config.engine.dtype, device)).removeprefix("torch.")
    kv: dict[str, Any] = {}
    if config.kv.num_blocks is not None:
        kv["num_gpu_blocks_override"] = config.kv.num_blocks
    if config.kv.memory_bytes is not None:
        kv["kv_cache_memory_bytes"] = config.kv.memory_bytes
    elif device.type == "cpu":
        kv["gpu_memory_utilization"] = CPU_MEMORY_UTILIZATION
    return EngineArgs(
        model=config.engine.model,
        dtype=dtype,
        max_model_len=config.batching.max_seq_len,
        max_num_seqs=config.batching.max_batch_size,
        seed=0,
        enable_prefix_caching=config.kv.prefix_caching,
        # vLLM's grammars need its tokenizer; tokens still go in and come out as ids
        skip_tokenizer_init=False,
        structured_outputs_config=StructuredOutputsConfig(
            backend="guidance",
            disable_any_whitespace=True,  # what the native engine does
        ),
        # logprobs after penalties, bias and temperature, as the native engine reports them
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        **lora_args(config),
        **kv,
    )


# vLLM takes these ranks (its punica kernels are built for them)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(config: WorkerConfig) -> dict[str, Any]:
    """vLLM's LoRA settings from ``--max-loras`` and ``--max-lora-rank`` (the rank rounded up to
    one vLLM takes); none where the worker serves no adapters."""
    engine = config.engine
    slots = engine.lora_slots("vllm")
    if slots <= 0:
        return {}
    rank = next((r for r in VLLM_LORA_RANKS if r >= engine.max_lora_rank), VLLM_LORA_RANKS[-1])
    return {"enable_lora": True, "max_loras": slots, "max_lora_rank": rank}
