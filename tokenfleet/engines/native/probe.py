"""Whether the runner computes the model it loaded: a short probe through transformers' own
forward (eager attention: the reference) and through the runner's path (prefill, then decode
steps, on the routes chosen at load). A runner whose logits part from the reference beyond its
dtype's tolerance is refused at load, naming the first layer that parts where it can: a model
the engine does not compute exactly is never served.

The reference forward also records what each layer asks of attention (a sliding window, a
softcap): the C++ kernels and the lean forward compute neither, so a model that asks for one
within its context runs on the torch route, which does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenfleet.engines.native.attention.paged import SEEN_VARIANTS

log = logging.getLogger(__name__)

PROBE_TOKENS = 20  # the probe's prompt (fewer where the pool is smaller)
DECODE_STEPS = 2  # then this many tokens through the decode path
# The largest |ours - reference| a logit may show, as a share of the row's largest |logit|. float32
# differs from the reference only in the order of sums; bf16 and fp16 round every product, and
# batched and fused shapes round differently, so near-ties may part but rows stay close.
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 0.06, torch.float16: 0.06}


class ModelMismatch(RuntimeError):
    """The runner's forward disagrees with transformers' on this model: refused, never served."""


@dataclass(frozen=True)
class Reference:
    """What transformers' forward makes of the probe: logits at the prompt's last position and
    at each decode step, every layer's output over the prompt, and each layer's attention
    variants (layer index -> sliding window, softcap; 0: none)."""

    tokens: list[int]
    prompt_tokens: int
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    variants: dict[int, tuple[int, float]]

    def attention_variants(self, max_seq_len: int) -> str | None:
        """What the model asks of attention that the C++ kernels and the lean forward do not
        compute (None: nothing): a window shorter than the context, or a softcap."""
        windows = sorted({w for w, _ in self.variants.values() if 0 < w < max_seq_len})
        caps = sorted({c for _, c in self.variants.values() if c})
        found = [f"a sliding window of {w} tokens" for w in windows] + [f"a softcap of {c:g}" for c in caps]
        return " and ".join(found) or None


def probe_tokens(vocab_size: int, room: int) -> list[int]:
    """A fixed prompt and continuation of ids drawn from the whole vocabulary (the same every load)."""
    count = min(PROBE_TOKENS, room - DECODE_STEPS) + DECODE_STEPS
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (count,), generator=generator).tolist()


@torch.inference_mode()
def take_reference(model: Any, tokens: list[int]) -> Reference:
    """transformers' eager forward over ``tokens`` (``model`` left on its own implementation),
    and the variants its layers ask of the attention function."""
    ids = torch.tensor([tokens], device=model.device)
    ours = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        model.set_attn_implementation(ours)
    seen: dict[int, tuple[int, float]] = {}
    token = SEEN_VARIANTS.set(seen)
    try:
        model(input_ids=ids[:, :2], use_cache=False)  # every layer calls ours once
    finally:
        SEEN_VARIANTS.reset(token)
    prompt = len(tokens) - DECODE_STEPS
    logits = out.logits[0, prompt - 1 :].float()
    hidden = tuple(h[0, :prompt].float() for h in out.hidden_states)
    return Reference(tokens, prompt, logits, hidden, seen)


def parted(ours: torch.Tensor, reference: torch.Tensor, tolerance: float) -> float | None:
    """How far ``ours`` is from ``reference`` relative to the latter's largest value, where
    that passes ``tolerance`` (None: within it)."""
    scale = float(reference.abs().max()) or 1.0
    distance = float((ours.float() - reference).abs().max()) / scale
    return distance if distance > tolerance or distance != distance else None  # NaN parts too


def check(
    reference: Reference,
    dtype: torch.dtype,
    prefill: Callable[[list[int]], torch.Tensor],
    decode: Callable[[int, int], torch.Tensor],
    layer_outputs: Callable[[list[int]], tuple[torch.Tensor, ...]] | None,
) -> None:
    """Run the probe through the runner's ``prefill`` (prompt ids -> last logits) and ``decode``
    (stored tokens, newest token -> logits); raise :class:`ModelMismatch` where a row parts from
    the reference. ``layer_outputs`` (prompt ids -> every layer's output), where the runner can
    give them, names the first layer that parts."""
    tolerance = TOLERANCE.get(dtype, 0.05)
    prompt = reference.tokens[: reference.prompt_tokens]
    rows = [prefill(prompt)]
    for step in range(DECODE_STEPS):
        stored = reference.prompt_tokens + step + 1
        rows.append(decode(stored, reference.tokens[stored - 1]))
    for row, ours in enumerate(rows):
        distance = parted(ours.reshape(-1), reference.logits[row], tolerance)
        if distance is None:
            continue
        where = "prefill" if row == 0 else f"decode step {row}"
        layer = first_parted_layer(reference, layer_outputs(prompt), tolerance) if layer_outputs else None
        raise ModelMismatch(
            f"the engine's forward parts from transformers' on this model ({where}: logits "
            f"{distance:.2g} of their scale apart, tolerance {tolerance:g}"
            + (f"; first at {layer})" if layer else ")")
            + ": refused rather than served wrong; --engine vllm may serve it"
        )
    log.info(
        "engine: the probe's logits agree with transformers' forward (%s)", str(dtype).removeprefix("torch.")
    )


def first_parted_layer(reference: Reference, ours: tuple[torch.Tensor, ...], tolerance: float) -> str | None:
    """The first of the model's hidden states (embeddings, then each layer's output) that parts."""
    for index, (mine, theirs) in enumerate(zip(ours, reference.hidden)):
        if parted(mine.reshape(theirs.shape), theirs, tolerance) is not None:
            return "the embeddings" if index == 0 else f"layer {index - 1}"
    return None


def check_runner(runner: Any, reference: Reference) -> None:
    """:func:`check` through ``runner``'s own prefill and decode, on the pool's first blocks (no
    sequence holds them yet); layers are named where transformers' forward runs the steps."""
    blocks = list(range(-(-len(reference.tokens) // runner.block_size)))

    def layer_outputs(prompt: list[int]) -> tuple[torch.Tensor, ...]:
        from tokenfleet.engines.native.attention.step_inputs import prefill_step

        lengths, table = torch.tensor([len(prompt)]), torch.tensor([blocks])
        ids, positions, _, meta = prefill_step(
            runner.store, runner.upload, table, lengths, torch.tensor(prompt), runner.use_prefill_kernel
        )
        with torch.inference_mode():
            out = runner.model.base_model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                tokenfleet_step=meta,
                output_hidden_states=True,
            )
        return tuple(h[0].float() for h in out.hidden_states)

    check(
        reference,
        runner.dtype,
        lambda prompt: runner.prefill([blocks], [prompt]).logits[0],
        lambda stored, token: runner.decode([blocks], [stored], [token])[0],
        layer_outputs if runner.lean is None else None,
    )
