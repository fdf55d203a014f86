"""A lean forward pass for Llama-family models on the CPU, in place of transformers' own.

Eager transformers runs ~45 operators and a dozen module calls a decoder layer; on SmolLM2
(30 layers of hidden size 576) that host work took a fifth of a batch-32 decode step. Here a layer
is eight calls: the norms with their residual adds, the rotary embedding and SiLU-and-multiply
each one C++ pass (``csrc/layer_ops_cpu.cpp``), and the query/key/value and gate/up projections
each one linear over weights concatenated at load (:func:`fuse_projections`).

The arithmetic is the model's own: each operation rounds where transformers' code rounds, so only
the order of the norm's sum of squares and SiLU's exp differ in the last bit (the greedy
equivalence tests run through this path). Models of other architectures keep transformers'
forward; so does ``--compile``, whose graphs fuse the same work themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from tokenfleet.engines.native.attention.paged import StepMetadata, paged_attention

log = logging.getLogger(__name__)

# Architectures whose layers are exactly: RMSNorm, q/k/v projections (biases allowed), rotate-half
# rotary embedding, attention, o projection, residual add, RMSNorm, SiLU-gated MLP, residual add.
FUSABLE_MODEL_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def unfusable_reason(model: Any) -> str | None:
    """Why ``model`` cannot take the lean forward (``None``: it can)."""
    cfg: Any = model.config.get_text_config()
    if cfg.model_type not in FUSABLE_MODEL_TYPES:
        return f"model type {cfg.model_type!r} (lean forward: {', '.join(FUSABLE_MODEL_TYPES)})"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "an MLP other than SiLU-gated"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype}"
    for layer in getattr(model.base_model, "layers", None) or [None]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ATTENTION_LINEARS]
        linears += [getattr(mlp, n, None) for n in MLP_LINEARS]
        if not all(type(m) is nn.Linear for m in linears):
            return "layers not made of the usual projections"
        if any(hasattr(attn, extra) for extra in ("q_norm", "k_norm")):
            return "query/key norms"
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return "a norm other than RMSNorm"
    return None


def concatenated(linears: list[nn.Linear]) -> nn.Linear:
    """One linear computing ``linears``' outputs side by side."""
    weight = torch.cat([m.weight.detach() for m in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    return fused


def fuse_projections(model: Any) -> None:
    """Replace each layer's q/k/v projections with one ``qkv_proj`` and gate/up with one
    ``gate_up_proj`` (the originals are dropped: transformers' forward no longer runs this model,
    :class:`LeanDecoder` does). Done before the linears are packed, so the fused ones are."""
    for layer in model.base_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = concatenated([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = concatenated([mlp.gate_proj, mlp.up_proj])
        for parent, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            for name in names:
                delattr(parent, name)


class LayerCalls(NamedTuple):
    """One layer's linears, attention module (for its layer index), scale and norm weights."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    attn: nn.Module
    scale: float
    o: Callable[[torch.Tensor], torch.Tensor]
    post_weight: torch.Tensor
    post_eps: float
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    next_weight: torch.Tensor  # the next layer's input norm (the final norm after the last layer)
    next_eps: float


class LeanDecoder:
    """The forward of a model whose projections :func:`fuse_projections` fused; called as the
    engine calls transformers' base model, returns the final hidden states ``[B, T, hidden]``."""

    def __init__(self, model: Any):
        base = model.base_model
        cfg = model.config.get_text_config()
        self.embed, self.rotary, self.layers = base.embed_tokens, base.rotary_emb, list(base.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.final_norm = base.norm
        self._plan: list[LayerCalls] = []

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        ops = torch.ops.tokenfleet
        norm, add_norm, rotary, silu_mul = (
            ops.rms_norm.default,
            ops.add_rms_norm.default,
            ops.rotary_.default,
            ops.silu_and_mul.default,
        )
        batch, steps = input_ids.shape
        tokens, head_dim = batch * steps, self.head_dim
        widths = [self.heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim]
        residual = self.embed(input_ids).view(tokens, -1)
        cos, sin = (t.reshape(tokens, head_dim) for t in self.rotary(residual, positions))
        first = self.layers[0].input_layernorm
        normed = norm(residual, first.weight, float(first.variance_epsilon))
        self._plan = self._plan or self._bind()
        rotated = self.heads + self.kv_heads  # the query and key heads
        for c in self._plan:
            query, key, value = rotary(c.qkv(normed), cos, sin, rotated).split(widths, 1)
            query = query.view(batch, steps, self.heads, head_dim).transpose(1, 2)
            key = key.view(batch, steps, self.kv_heads, head_dim).transpose(1, 2)
            value = value.view(batch, steps, self.kv_heads, head_dim).transpose(1, 2)
            out, _ = paged_attention(c.attn, query, key, value, None, c.scale, tokenfleet_step=meta)
            normed = add_norm(c.o(out.reshape(tokens, widths[0])), residual, c.post_weight, c.post_eps)
            normed = add_norm(c.down(silu_mul(c.gate_up(normed))), residual, c.next_weight, c.next_eps)
        return normed.view(batch, steps, -1)

    def _bind(self) -> list[LayerCalls]:
        """What each layer's step calls, looked up once: on the first step, after the engine has
        packed the linears (each module's ``forward`` called directly: no hooks are set)."""
        plan = []
        # each add-and-norm takes the next norm's weight: layer i's MLP output feeds layer i + 1's input norm
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.final_norm]
        for layer, next_norm in zip(self.layers, next_norms):
            attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
            plan.append(
                LayerCalls(
                    attn.qkv_proj.forward,
                    attn,
                    float(attn.scaling),
                    attn.o_proj.forward,
                    post.weight,
                    float(post.variance_epsilon),
                    mlp.gate_up_proj.forward,
                    mlp.down_proj.forward,
                    next_norm.weight,
                    float(next_norm.variance_epsilon),
                )
            )
        return plan


def lean_decoder(model: Any) -> LeanDecoder | None:
    """Fuse ``model``'s projections and return its lean forward, or ``None`` (logged) where its
    architecture is not one :class:`LeanDecoder` computes exactly."""
    reason = unfusable_reason(model)
    if reason is not None:
        log.info("engine: transformers' forward (no lean forward for %s)", reason)
        return None
    fuse_projections(model)
    log.info("engine: lean forward, q/k/v and gate/up projections fused, norms and rotary in C++")
    return LeanDecoder(model)
