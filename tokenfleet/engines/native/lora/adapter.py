"""A LoRA adapter read from a local directory in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), checked against the model it will run on: each targeted linear's
low-rank ``A`` ``[r, in]`` and ``B`` ``[out, r]`` and its scale. Anything the engine would not
compute exactly as PEFT does (DoRA, biases, layers PEFT trains whole, embeddings or the LM head as
targets, a pickled ``.bin``) is refused with the reason, and so is a rank over ``--max-lora-rank``
or a weight whose shape the model's linear does not have: that request fails alone, with
``adapter_unavailable``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenfleet.engines.native.lora.files import SafetensorsError, read_tensors, shapes

T = TypeVar("T")
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# fields whose non-default value means PEFT computes something this engine does not
UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
}


class AdapterError(ValueError):
    """An adapter that cannot run on this model: missing, corrupt, unsupported or the wrong shape."""


@dataclass(frozen=True)
class ModuleDelta:
    """One linear's low-rank update: ``y += scale * (x @ shrink.T) @ expand`` (PEFT's lora_A, and
    its lora_B transposed: the kernel reads both along their rows)."""

    shrink: torch.Tensor  # [rank, in_features]
    expand: torch.Tensor  # [rank, out_features]
    scale: float

    @property
    def rank(self) -> int:
        return self.shrink.shape[0]


@dataclass(frozen=True)
class Adapter:
    """A loaded adapter: its name and the update of each linear it targets (by the module's name
    in the model, e.g. ``model.layers.0.self_attn.q_proj``)."""

    name: str
    deltas: dict[str, ModuleDelta]

    @property
    def nbytes(self) -> int:
        return sum(
            d.shrink.numel() * d.shrink.element_size() + d.expand.numel() * d.expand.element_size()
            for d in self.deltas.values()
        )


def load_adapter(
    name: str, directory: str, linears: dict[str, tuple[int, int]], max_rank: int, dtype: torch.dtype
) -> Adapter:
    """Read and check the adapter at ``directory``; ``linears``: the model's adaptable linears,
    name -> (in_features, out_features). Raises :class:`AdapterError` saying why it cannot run."""
    root = Path(directory)
    config = read_config(root)
    weights_path = root / WEIGHTS
    if not weights_path.is_file():
        raise AdapterError(f"{directory} has no {WEIGHTS} (a pickled .bin is never loaded: convert it)")
    # the most bytes an adapter of these linears at --max-lora-rank holds (float64, with a header)
    largest = 8 * max_rank * sum(i + o for i, o in linears.values()) + (1 << 20)
    try:
        weights = read_tensors(weights_path, largest)
    except (SafetensorsError, OSError) as e:
        raise AdapterError(f"{weights_path} cannot be read: {e}") from None
    pairs = paired(weights)
    if not pairs:
        raise AdapterError(f"{weights_path} holds no lora_A/lora_B weights")
    deltas = {}
    for module, (a, b) in pairs.items():
        check_module(module, tuple(a.shape), tuple(b.shape), linears, max_rank)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{module}: the weights hold NaN or infinity")
        deltas[module] = (
            ModuleDelta(  # copies (even where already in dtype and layout): the file's buffer is let go
                a.to(dtype, copy=True),
                b.to(dtype).t().clone(memory_format=torch.contiguous_format),
                scale_of(config, module, a.shape[0]),
            )
        )
    return Adapter(name, deltas)


def check_module(
    module: str,
    a_shape: tuple[int, ...],
    b_shape: tuple[int, ...],
    linears: dict[str, tuple[int, int]],
    max_rank: int,
) -> None:
    """``module``'s lora_A and lora_B shapes fit the model's linear, at a rank within ``max_rank``."""
    if module not in linears:
        raise AdapterError(f"the adapter targets {module!r}, which is not a linear of this model's layers")
    in_features, out_features = linears[module]
    rank = a_shape[0] if a_shape else 0
    if rank < 1 or a_shape != (rank, in_features) or b_shape != (out_features, rank):
        raise AdapterError(
            f"{module}: lora_A {a_shape} and lora_B {b_shape} do not fit the model's "
            f"linear ({in_features} in, {out_features} out)"
        )
    if rank > max_rank:
        raise AdapterError(f"{module} has rank {rank}, above this worker's --max-lora-rank {max_rank}")


def check_adapter_files(
    directory: str, max_rank: int, linears: dict[str, tuple[int, int]] | None = None
) -> None:
    """Without loading its weights: ``directory`` holds a PEFT LoRA adapter this engine's rules
    allow, of rank at most ``max_rank``, whose weights fit ``linears`` (the model's, name ->
    (in_features, out_features), when known): what a backend that loads adapters itself, and
    would fail a whole step on a bad one, is handed."""
    config = read_config(Path(directory))
    pattern = config.get("rank_pattern") or {}
    ranks = [config.get("r", 8), *(pattern.values() if isinstance(pattern, dict) else [None])]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise AdapterError(f"{directory}: ranks must be positive integers, got {ranks}")
    if max(ranks) > max_rank:
        raise AdapterError(f"rank {max(ranks)} is above this worker's --max-lora-rank {max_rank}")
    weights = Path(directory) / WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{directory} has no {WEIGHTS} (a pickled .bin is never loaded: convert it)")
    try:  # the header only: a truncated or corrupt file fails here, not in the backend's step
        pairs = paired(shapes(weights))
    except (SafetensorsError, OSError) as e:
        raise AdapterError(f"{weights} cannot be read: {e}") from None
    if not pairs:
        raise AdapterError(f"{weights} holds no lora_A/lora_B weights")
    for module, (a_shape, b_shape) in pairs.items():
        if linears is not None:
            check_module(module, a_shape, b_shape, linears, max_rank)
        elif (
            len(a_shape) != 2
            or len(b_shape) != 2
            or a_shape[0] != b_shape[1]
            or not 1 <= a_shape[0] <= max_rank
        ):
            raise AdapterError(f"{module}: lora_A {a_shape} and lora_B {b_shape} are not a LoRA pair")


def read_config(root: Path) -> dict[str, Any]:
    path = root / CONFIG
    if not path.is_file():
        raise AdapterError(f"{root} is not a PEFT adapter directory: no {CONFIG}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    for field, default in UNSUPPORTED.items():
        if config.get(field, default) not in (default, [], {}):
            raise AdapterError(
                f"{path}: {field}={config[field]!r} is not supported (this engine adds plain LoRA updates)"
            )
    return config


def paired(weights: dict[str, T]) -> dict[str, tuple[T, T]]:
    """``{module: (A, B)}`` from PEFT's keys (``base_model.model.<module>.lora_A.weight``), for
    tensors or their shapes."""
    halves: dict[str, dict[str, T]] = {}
    for key, tensor in weights.items():
        for half in ("lora_A", "lora_B"):
            marker = f".{half}."
            if marker in key:
                module = key.split(marker)[0].removeprefix("base_model.model.")
                halves.setdefault(module, {})[half] = tensor
    unmatched = [m for m, h in halves.items() if len(h) != 2]
    if unmatched:
        raise AdapterError(f"{unmatched[0]} has lora_A or lora_B but not both")
    return {m: (h["lora_A"], h["lora_B"]) for m, h in halves.items()}


def scale_of(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for ``module``: its alpha (``alpha_pattern`` first, by the longest key that
    ends the module's name) over its rank, or over the rank's square root with ``use_rslora``."""
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    matches = [k for k in patterns if module == k or module.endswith("." + k)]
    if matches:
        alpha = patterns[max(matches, key=len)]
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
