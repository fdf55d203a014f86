"""Small Llama-architecture models with seeded random weights, built locally (no hub).

``tokenfleet model init DIR`` writes one the way Hugging Face saves models: ``config.json``,
``model.safetensors``, ``generation_config.json`` and a byte-level ``tokenizer.json`` that both
``AutoTokenizer.from_pretrained(DIR)`` and the plain ``tokenizers`` library load offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Qwen2's layout: q/k/v biases and a 152k vocabulary tied to the embedding
QWEN2 = dict(architecture="qwen2", vocab_size=151_936, tie_word_embeddings=True)
SIZES: dict[str, dict[str, Any]] = {
    # a few M parameters: fast enough for tests on 2 CPU cores; 2 KV heads exercise GQA
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~113M parameters: hidden 768, 12 layers, for benchmarks
    "small": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
    ),
    # Shapes of other common architectures, so that no single shape is what the engine is tuned
    # for (benchmarks; random weights measure speed, not text). Qwen2-style: q/k/v biases,
    # head_dim 128, 4 query heads per KV head, a 152k vocabulary tied to the embedding.
    "qwen2-like": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        **QWEN2,
    ),
    # a wider Llama: hidden 2048, head_dim 128, few layers
    "wide": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32_000,
    ),
    # The shapes users run on CPU workers (issue 51's benchmarks): the published configurations of
    # Qwen2.5-0.5B / -1.5B and Llama-3.2-1B, with random weights and a byte-level tokenizer.
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        **QWEN2,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        **QWEN2,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128_256,
        tie_word_embeddings=True,
        rope_theta=500_000.0,
    ),
}
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
VOCAB_SIZE = 320  # 3 specials + 256 bytes, rounded up to a multiple of 64


def build_byte_tokenizer(vocab_size: int = 0):
    """A byte-level BPE tokenizer without merges: every UTF-8 byte is one token, BOS prepended.
    ``vocab_size`` above the bytes: filler tokens ``<|xN|>`` up to it, never produced by encoding,
    so that every id a larger model generates decodes to text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps each byte to a printable character; order the vocab by byte value.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    mapping = bytes_to_unicode()
    assert set(mapping.values()) == set(byte_chars)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[mapping[byte]] = len(vocab)
    for filler in range(len(vocab), vocab_size):
        vocab[f"<|x{filler}|>"] = filler
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    return tok


def init_model(
    directory: str | Path, size: str = "tiny", seed: int = 0, max_position_embeddings: int = 4096
) -> Path:
    """Write a random-weight model (Llama, or the architecture its size names) and its tokenizer
    to ``directory``; returns the path."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    shape: dict[str, Any] = dict(SIZES[size])
    architecture = shape.pop("architecture", "llama")
    vocab_size = shape.pop("vocab_size", VOCAB_SIZE)
    config_class: Any = LlamaConfig
    model_class: Any = LlamaForCausalLM
    if architecture == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config_class, model_class = Qwen2Config, Qwen2ForCausalLM
    config = config_class(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=shape.pop("tie_word_embeddings", False),
        # Wider than the 0.02 default so a random model's greedy output varies token to token
        # instead of repeating one byte: equivalence tests then compare something meaningful.
        initializer_range=0.1,
        **shape,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(out)
    build_byte_tokenizer(vocab_size if vocab_size > VOCAB_SIZE else 0).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": max_position_embeddings,
            },
            indent=2,
        )
    )
    return out


def is_model_dir(directory: str | Path) -> bool:
    path = Path(directory)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
