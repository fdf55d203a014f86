"""A sentence-transformers directory served as sentence-transformers serves it: the transformer
(``modules.json``'s first module, any ``AutoModel``: BERT-family encoders, or decoders such as
Qwen3-Embedding), then its pooling (``1_Pooling/config.json``: mean, CLS, max, last token, mean
over the square root of the length) and, where the directory asks for it, normalisation. Texts
are tokenized as sentence-transformers does (``max_seq_length``, lower-casing where configured)
and run in batches of similar lengths, so that little padding is computed. Modules other than
those (a Dense projection, a custom module) are refused by name: vectors that differ from the
model's are worse than none."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenfleet.engines.embed.packed import PackedBert, pool_packed, split_by_length
from tokenfleet.engines.embed.packed import supports as packed_supports
from tokenfleet.protocol.embed import EmbedSpec

POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
PACKED_TOKENS = 4096  # real tokens per packed call: activations stay in cache (larger ran slower)


class EmbedModelError(ValueError):
    """The directory is not a sentence-transformers model this engine computes exactly."""


@dataclass(frozen=True)
class Pipeline:
    """What ``modules.json`` and its modules' configs ask for."""

    pooling: str  # one of POOLING_MODES
    normalize: bool
    max_seq_length: int | None
    lower_case: bool
    dimension: int


def read_pipeline(directory: str | Path) -> Pipeline:
    """The pooling and normalisation of the sentence-transformers model at ``directory``."""
    root = Path(directory)
    modules = _json(root / "modules.json")
    if not isinstance(modules, list) or not modules:
        raise EmbedModelError(f"{root / 'modules.json'} lists no modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds[0] != "Transformer" or kinds.count("Pooling") != 1 or kinds.index("Pooling") != 1:
        raise EmbedModelError(f"{root}: modules {kinds} are not Transformer, Pooling[, Normalize]")
    unsupported = [k for k in kinds[2:] if k != "Normalize"]
    if unsupported:
        supported = "Transformer, Pooling, Normalize"
        raise EmbedModelError(f"{root}: module {unsupported[0]} is not supported ({supported})")
    pooling = _json(root / str(modules[1].get("path", "1_Pooling")) / "config.json")
    chosen = pooling_modes(pooling)
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise EmbedModelError(f"{root}: pooling {chosen or 'none'} is not one of {', '.join(POOLING_MODES)}")
    bert = root / "sentence_bert_config.json"
    config = _json(bert) if bert.is_file() else {}
    return Pipeline(
        pooling=chosen[0],
        normalize="Normalize" in kinds,
        max_seq_length=config.get("max_seq_length"),
        lower_case=bool(config.get("do_lower_case", False)),
        dimension=int(pooling.get("embedding_dimension") or pooling["word_embedding_dimension"]),
    )


def pooling_modes(config: dict[str, Any]) -> list[str]:
    """The pooling modes a Pooling config turns on: sentence-transformers 5's ``pooling_mode``
    (a name, or several), or the earlier ``pooling_mode_<mode>`` flags."""
    if "pooling_mode" in config:
        named = config["pooling_mode"]
        names = [named] if isinstance(named, str) else list(named or [])
        short = {
            "cls": "cls_token",
            "mean": "mean_tokens",
            "max": "max_tokens",
            "weightedmean": "weightedmean_tokens",
        }
        return [short.get(str(n), str(n)) for n in names]
    flags = (*POOLING_MODES, "weightedmean_tokens")
    return [m for m in flags if config.get(f"pooling_mode_{m}")]


def is_sentence_transformers(directory: str | Path) -> bool:
    return (Path(directory) / "modules.json").is_file()


class EmbedModel:
    """What every engine's embedding model shares: the pipeline, the tokenizer and the longest input
    of the sentence-transformers directory at ``directory``. :meth:`pooled` (the forward passes and
    pooling) is the engine's; :meth:`embed` cuts and normalises the pooled vectors."""

    backend = "native"
    dtype = "float32"

    def __init__(self, directory: str | Path, positions: int | None = None):
        from transformers import AutoTokenizer

        self.pipeline = read_pipeline(directory)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        limits = [n for n in (self.pipeline.max_seq_length, self.tokenizer.model_max_length, positions) if n]
        self.max_tokens = min(limits) if limits else 512
        self.vocab_size = len(self.tokenizer)

    def tokenize(self, texts: Sequence[str], truncate: bool = True) -> list[list[int]]:
        """Each text's token ids, as sentence-transformers makes them (special tokens, truncation
        to the model's length unless ``truncate`` is false)."""
        if self.pipeline.lower_case:
            texts = [t.lower() for t in texts]
        limit = {"truncation": True, "max_length": self.max_tokens} if truncate else {}
        return list(self.tokenizer(list(texts), **limit)["input_ids"])

    def pooled(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 pooled vectors ``[len(inputs), dimension]`` of tokenized inputs, in their order,
        not normalised."""
        raise NotImplementedError

    def embed(
        self, inputs: Sequence[Sequence[int]], dimensions: int | None = None, normalize: bool | None = None
    ) -> torch.Tensor:
        """Float32 vectors ``[len(inputs), dimensions or the model's]`` of tokenized inputs (see
        :meth:`tokenize`), in their order. ``dimensions``: keep the first ones, then normalise
        again (models trained for it); ``normalize``: the model's own choice when None."""
        out = self.pooled(inputs)
        if dimensions is not None:  # Matryoshka: the first ones, a unit vector again
            out = out[:, :dimensions]
        if normalize is None:
            normalize = self.pipeline.normalize or dimensions is not None
        return torch.nn.functional.normalize(out, p=2, dim=1) if normalize else out


class Embedder(EmbedModel):
    """The model at ``directory`` in ``dtype``, run by torch: BERT-family encoders packed (see
    :mod:`.packed`), any other ``AutoModel`` by its own forward over batches of similar lengths."""

    def __init__(self, directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from transformers import AutoModel

        self.device = torch.device(device)
        # in eval mode, as loaded
        self.model = AutoModel.from_pretrained(directory, dtype=dtype).to(self.device)
        super().__init__(directory, getattr(self.model.config, "max_position_embeddings", None))
        # ids past the model's table would fail the whole batch's forward
        self.vocab_size = min(self.vocab_size, self.model.get_input_embeddings().num_embeddings)
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self.packed = PackedBert(self.model) if packed_supports(self.model) else None

    @torch.inference_mode()
    def pooled(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out = torch.empty(len(inputs), self.pipeline.dimension)
        ranges = split_by_length([len(inputs[i]) for i in order])
        if self.packed is not None:  # the linears over every input's real tokens at once
            for chunk in _chunks(ranges, [len(inputs[i]) for i in order]):
                first, last = chunk[0][0], chunk[-1][1]
                ids = [inputs[i] for i in order[first:last]]
                tokens = self.packed(ids)
                pooled = pool_packed(tokens, [len(x) for x in ids], self.pipeline.pooling)
                out[order[first:last]] = pooled.float().cpu()
        else:
            for start, end in ranges:
                batch = order[start:end]
                out[batch] = self._forward([list(inputs[i]) for i in batch]).float().cpu()
        return out

    def _forward(self, ids: list[list[int]]) -> torch.Tensor:
        features = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        if "token_type_ids" in self.tokenizer.model_input_names:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        on_device = {k: v.to(self.device) for k, v in features.items()}
        mask = on_device["attention_mask"]
        tokens = self.model(**on_device).last_hidden_state
        return pool(tokens, mask, self.pipeline.pooling)


def _chunks(ranges: list[tuple[int, int]], lengths: list[int]) -> list[list[tuple[int, int]]]:
    """``ranges`` gathered into calls of at most :data:`PACKED_TOKENS` real tokens (memory)."""
    chunks: list[list[tuple[int, int]]] = [[]]
    held = 0
    for start, end in ranges:
        size = sum(lengths[start:end])
        if chunks[-1] and held + size > PACKED_TOKENS:
            chunks.append([])
            held = 0
        chunks[-1].append((start, end))
        held += size
    return chunks


def pool(tokens: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling of ``tokens`` [batch, length, hidden] under ``mask``."""
    if mode == "cls_token":  # the first attended position (a left-padded batch starts with padding)
        return tokens[torch.arange(tokens.shape[0]), mask.argmax(1)]
    if mode == "lasttoken":  # the last attended position, whichever side the padding is on
        seen, flipped = mask.flip(1).max(1)
        last = tokens.shape[1] - 1 - torch.where(seen == 0, tokens.shape[1] - 1, flipped)
        return tokens[torch.arange(tokens.shape[0]), last]
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    if mode == "max_tokens":
        return tokens.masked_fill(weights == 0, torch.finfo(tokens.dtype).min).max(1).values
    summed, counts = (tokens * weights).sum(1), weights.sum(1).clamp(min=1e-9)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len_tokens" else counts)


def vector_bytes(pooled: torch.Tensor, spec: EmbedSpec, model_normalizes: bool) -> bytes:
    """The vector a request asked for, as the wire carries it (little-endian float32 bytes): its
    first ``dimensions``, normalised as asked (by default as the model does, and always after a
    cut)."""
    vector = pooled if spec.dimensions is None else pooled[: spec.dimensions]
    normalize = spec.normalize
    if normalize is None:
        normalize = model_normalizes or spec.dimensions is not None
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=0)
    return vector.float().numpy().astype("<f4").tobytes()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EmbedModelError(f"{path} cannot be read: {e}") from None
