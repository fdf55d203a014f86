"""Embeddings against sentence-transformers itself, in float32: all-MiniLM-L6-v2 from the package
registry (an encoder, mean pooling, normalised) on texts of mixed lengths, one past its 256-token
limit; Matryoshka truncation (the first dimensions, a unit vector again); and a decoder with
last-token pooling (random weights, saved as a sentence-transformers directory here)."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.engines.embed.model import Embedder, EmbedModelError, read_pipeline

pytestmark = pytest.mark.integration

TEXTS = [
    "A cat sits on the mat.",
    "",
    "Queues decouple the callers from the workers: nothing is lost when a worker dies mid-request.",
    "naïve café — 東京 🚀",
    "word " * 400,  # past max_seq_length: truncated as sentence-transformers truncates
    "Short.",
    "The quick brown fox jumps over the lazy dog. " * 12,
]


def reference(directory: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(directory, device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=3).float()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert cosine.min() >= 0.99999, cosine


def test_minilm_vectors_equal_sentence_transformers(minilm):
    embedder = Embedder(minilm)
    assert read_pipeline(minilm).pooling == "mean_tokens" and embedder.pipeline.normalize
    got = embedder.embed(embedder.tokenize(TEXTS))
    assert_close(got, reference(minilm, TEXTS))
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_dimensions_keep_the_first_ones_then_normalise(minilm):
    embedder = Embedder(minilm)
    got = embedder.embed(embedder.tokenize(TEXTS), dimensions=128)
    want = torch.nn.functional.normalize(reference(minilm, TEXTS)[:, :128], dim=1)
    assert_close(got, want)


def test_a_decoder_with_last_token_pooling_equals_sentence_transformers(tiny_model, tmp_path):
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(tiny_model, max_seq_length=64)
    transformer.tokenizer.pad_token = transformer.tokenizer.pad_token or transformer.tokenizer.eos_token
    transformer.tokenizer.padding_side = "left"  # as Qwen3-Embedding pads
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    directory = str(tmp_path / "decoder-embed")
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").save(directory)
    embedder = Embedder(directory)
    assert embedder.pipeline.pooling == "lasttoken"
    texts = [t for t in TEXTS if t]
    assert_close(embedder.embed(embedder.tokenize(texts)), reference(directory, texts))


def test_a_module_it_does_not_compute_is_refused_by_name(minilm, tmp_path):
    import json
    import shutil

    directory = tmp_path / "with-dense"
    shutil.copytree(minilm, directory)
    modules = json.loads((directory / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (directory / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(EmbedModelError, match="Dense"):
        read_pipeline(directory)


def test_length_splits_compute_the_fewest_tokens():
    from tokenfleet.engines.embed.packed import FORWARD_COST_TOKENS, split_by_length

    # three short and two long: padding the short ones to 250 costs more than a second pass
    assert split_by_length([8, 8, 8, 250, 250]) == [(0, 3), (3, 5)]
    # nearly equal lengths: one pass (a second costs more than the padding it saves)
    assert split_by_length([100, 101, 102, 103]) == [(0, 4)]
    # attention's cost grows with the square of the length: it cuts where linears would not
    lengths = [60, 64, 100, 128]
    assert len(split_by_length(lengths, power=2, per_pass=1000)) > len(split_by_length(lengths))
    assert FORWARD_COST_TOKENS > 0


def test_generation_flags_on_an_embedding_model_are_refused_not_ignored(minilm):
    from tokenfleet.config import EngineConfig, WorkerConfig
    from tokenfleet.engines import build_core

    config = WorkerConfig(EngineConfig(model=minilm, compile=True, f32_linear="onednn"))
    with pytest.raises(ValueError, match="--compile, --f32-linear: not used by an embedding model"):
        build_core(config)


def test_onednn_epilogues_equal_the_operations_after_the_gemm():
    """The packed encoder's GELU and residual adds run in oneDNN's GEMM epilogue: bit for bit the
    values of the separate operations (float32)."""
    import torch.nn.functional as F

    from tokenfleet.engines.native.linear.onednn import PackedLinear

    torch.manual_seed(0)
    linear = PackedLinear(torch.nn.Linear(384, 1536), rows_hint=4096)
    x, residual = torch.randn(300, 384), torch.randn(300, 1536)
    with torch.inference_mode():
        assert torch.equal(linear.gelu(x), F.gelu(linear(x)))
        assert torch.equal(linear.plus(x, residual), linear(x) + residual)
