"""Tiny random-weight models of many architectures, built locally (no hub), for checking that the
engine serves each one exactly or refuses it: each family's config as transformers names it, a
byte-level tokenizer, greedy generation config. Sliding windows are shorter than the test prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenfleet.models.random_init import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_byte_tokenizer

LAYERS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
GQA = dict(LAYERS, num_key_value_heads=2)
WINDOW = 8  # tokens: shorter than every test prompt, so the window changes the answer

# name -> (transformers model type, config fields)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", GQA),
    "mistral": ("mistral", dict(GQA, sliding_window=None)),
    "mistral-window": ("mistral", dict(GQA, sliding_window=WINDOW)),
    "qwen2": ("qwen2", GQA),
    "qwen2-window": ("qwen2", dict(GQA, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "qwen3": ("qwen3", dict(GQA, head_dim=16)),
    "gemma": ("gemma", dict(GQA, head_dim=16)),
    "gemma2": ("gemma2", dict(GQA, head_dim=16, sliding_window=WINDOW)),  # softcaps, windowed layers
    "gemma3": ("gemma3_text", dict(GQA, head_dim=16, sliding_window=WINDOW)),
    "phi": ("phi", LAYERS),
    "phi3": ("phi3", GQA),
    "stablelm": ("stablelm", GQA),  # partial rotary, LayerNorm; drops kwargs before attention
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4)),
    "gpt_neox": ("gpt_neox", LAYERS),
    "olmo2": ("olmo2", GQA),
    "granite": ("granite", dict(GQA, logits_scaling=4.0)),
    "cohere": ("cohere", dict(GQA, logit_scale=0.5)),
    "starcoder2": ("starcoder2", dict(GQA, sliding_window=None)),
    "mixtral": ("mixtral", dict(GQA, num_local_experts=4, num_experts_per_tok=2)),
}
# ALiBi: position biases inside attention, which the paged attention function does not add
REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4))
}


def build_family(name: str, directory: Path) -> str:
    """Write family ``name``'s tiny model with seeded random weights to ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_type, fields = {**FAMILIES, **REFUSED}[name]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.1,  # wide enough that greedy output varies token to token
        **fields,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_byte_tokenizer().save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "pad_token": "<pad>"}))
    return str(directory)
