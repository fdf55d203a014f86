"""The lean forward's C++ layer operators against transformers' own code on the same tensors
(norms, rotary embedding, SiLU-and-multiply: rounded where transformers rounds), and the lean
forward against transformers' forward on a whole model."""

import pytest
import torch
from conftest import make_runner
from transformers.models.llama.modeling_llama import (
    LlamaConfig,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("kernels"),  # built (or loaded) when the first test runs
]
DTYPES = [torch.float32, torch.bfloat16]


def ops():
    return torch.ops.tokenfleet


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100])  # a multiple of the vector width, and not
def test_norms_equal_transformers_up_to_the_order_of_one_sum(dtype, width):
    gen = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(width, generator=gen).to(dtype)
    x = (3 * torch.randn(37, width, generator=gen)).to(dtype)
    residual = torch.randn(37, width, generator=gen).to(dtype)
    # one rounding of the scale, at most, from a sum in another order
    close = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.0, "rtol": 1 / 128}
    torch.testing.assert_close(ops().rms_norm(x, norm.weight, 1e-5), norm(x), **close)
    updated = residual.clone()
    out = ops().add_rms_norm(x, updated, norm.weight, 1e-5)
    assert torch.equal(updated, residual + x)  # the residual add, in place, rounded as torch rounds
    torch.testing.assert_close(out, norm(residual + x), **close)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: a half that is no whole number of vectors
def test_rotary_equals_transformers_bit_for_bit(dtype, head_dim):
    heads, kv_heads, tokens = 6, 2, 21
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(qkv, torch.arange(tokens)[None] * 13)
    q = qkv[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim)
    want_q, want_k = apply_rotary_pos_emb(q, k.transpose(1, 2), cos, sin)
    got = ops().rotary_(qkv.clone(), cos[0].contiguous(), sin[0].contiguous(), heads + kv_heads)
    got_q = got[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    got_k = got[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim)
    assert torch.equal(got_q, want_q) and torch.equal(got_k.transpose(1, 2), want_k)
    assert torch.equal(got[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_transformers(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(19, 2 * 1000, generator=gen)).to(dtype)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -10.0, 0.0, 10.0, 90.0, 200.0, float("nan")])
    want = torch.nn.functional.silu(gate_up[:, :1000]) * gate_up[:, 1000:]
    got = ops().silu_and_mul(gate_up)
    # exp from another library: the last bit in float32; bf16's rounding hides it
    close = {"atol": 1e-30, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-30, "rtol": 1 / 128}
    torch.testing.assert_close(got, want, equal_nan=True, **close)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_forward_equals_transformers_forward(tiny_model, dtype):
    from transformers import AutoModelForCausalLM

    from tokenfleet.engines.native.attention.paged import register
    from tokenfleet.engines.native.decoder import lean_decoder

    runner = make_runner(tiny_model, device="cpu", dtype=str(dtype).removeprefix("torch."))
    assert runner.lean is not None
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype, attn_implementation=register())
    prompts = [list(range(3, 40)), list(range(50, 61)), [7]]
    tables = [[0, 1, 2], [3], [4]]
    logits = runner.prefill(tables, prompts).logits
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            want = hf(torch.tensor([prompt])).logits[0, -1].float()
            # bf16: within 4 bf16 ulps of the largest logit. Every op rounds to bf16 and the
            # library's bf16 GEMMs sum in their own order on each CPU kind (an AVX2 EPYC: 3.5 ulps)
            ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())).item() - 7)
            atol = 2e-4 if dtype == torch.float32 else 4 * ulp
            torch.testing.assert_close(logits[row], want, atol=atol, rtol=0)
            assert logits[row].argmax() == want.argmax()
    # the lean forward's fusion drops transformers' q/k/v and gate/up projections
    lean_decoder(hf)
    layer = hf.model.layers[0]
    assert not hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_up_proj")


def test_models_of_other_architectures_keep_transformers_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    from tokenfleet.engines.native.decoder import unfusable_reason

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in (unfusable_reason(model) or "")
