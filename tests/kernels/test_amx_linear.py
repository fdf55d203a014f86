"""bf16 linears on AMX tiles (``csrc/linear_amx_cpu.cpp``): float32 sums of the bf16 products
rounded once, for any shape (padded tiles, partial row chunks, a bias, NaN); prefill-sized calls
left to oneDNN on the original weight, which a tied embedding keeps sharing; taken by ``auto``
only where it measures faster and fits in memory; an engine on it agrees with one on oneDNN."""

import logging

import linear_kernels
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenfleet.engines.native.linear import amx as amx_linear
from tokenfleet.engines.native.linear import routes as cpu_linear
from tokenfleet.engines.native.linear.amx import AMX_MAX_ROWS, AmxLinear

needs_amx = linear_kernels.needs_kernel(
    amx_linear.amx_kernel_available,
    "tokenfleet::linear_amx needs a CPU with AMX-BF16 (a Sapphire Rapids Xeon)",
)


@needs_amx
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "rows, in_features, out_features",
    [
        (1, 576, 960),  # one decode row against SmolLM2's fused QKV
        (7, 40, 25),  # fewer features than one tile holds on both sides: zero padded
        (32, 256, 688),  # a full 32-row chunk; a last column pair of 16
        (33, 100, 50),  # one row past the chunk; a partial last tile of K
        (256, 576, 1536),  # the most rows the tiles take (AMX_MAX_ROWS): 8 chunks of 32
    ],
)
def test_amx_tiles_round_float32_sums_of_the_bf16_products_once(bias, rows, in_features, out_features):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, in_features).to(torch.bfloat16)  # a leading batch dimension, as HF passes
    with torch.inference_mode():
        native = linear(x)
        got = AmxLinear(linear)(x)
    assert got.dtype is torch.bfloat16 and got.shape == (*x.shape[:-1], out_features)
    bias = None if linear.bias is None else linear.bias.double()
    exact = F.linear(x.double(), linear.weight.double(), bias)
    # float32 sums in the tiles' order: at most one bf16 step from the rounded exact value
    assert torch.allclose(got.double(), exact.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-6)
    assert (got.double() - exact).abs().max() <= (native.double() - exact).abs().max() * 1.5 + 1e-6


@needs_amx
def test_nan_and_inf_pass_through_the_tiles():
    weight = torch.ones(32, 32, dtype=torch.bfloat16)
    x = torch.ones(3, 32, dtype=torch.bfloat16)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    packed = torch.ops.tokenfleet.pack_linear_amx(weight)
    got = torch.ops.tokenfleet.linear_amx(x, packed, 32, None)
    assert (got[0] == 32).all() and got[1].isnan().all() and (got[2] == float("inf")).all()


@needs_amx
def test_prefill_rows_go_to_onednn_on_the_shared_original_weight():
    torch.manual_seed(0)
    embed = nn.Embedding(64, 32).to(torch.bfloat16)
    head = nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    head.weight = embed.weight  # tied: the AmxLinear keeps the same tensor for its prefill calls
    amx = AmxLinear(head)
    assert amx.weight is embed.weight
    big = torch.randn(AMX_MAX_ROWS + 1, 32).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(amx(big), F.linear(big, embed.weight))  # oneDNN's own bits


@needs_amx
def test_the_tiles_run_inside_a_compiled_graph():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    module = AmxLinear(linear)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(torch.compile(module, fullgraph=True)(x), module(x))


def test_auto_takes_the_tiles_only_where_they_measure_faster_and_fit(monkeypatch, caplog):
    cpu = torch.device("cpu")
    linears = [nn.Linear(64, 64, bias=False).to(torch.bfloat16) for _ in range(2)]
    monkeypatch.setattr(amx_linear, "amx_kernel_available", lambda: True)
    monkeypatch.setattr(amx_linear, "available_memory_bytes", lambda: 2**30)
    monkeypatch.setattr(amx_linear, "amx_speedup", lambda: 1.8)  # as on a 2-vCPU AMX Xeon
    with caplog.at_level(logging.INFO, logger=amx_linear.__name__):
        assert amx_linear.amx_wanted(cpu, torch.bfloat16, "auto", linears)
    assert "1.80x oneDNN's GEMM" in caplog.text and "taken for calls of up to" in caplog.text
    assert not amx_linear.amx_wanted(cpu, torch.float32, "auto", linears)
    assert not amx_linear.amx_wanted(cpu, torch.bfloat16, "native", linears)
    monkeypatch.setattr(amx_linear, "amx_speedup", lambda: 1.0)
    assert not amx_linear.amx_wanted(cpu, torch.bfloat16, "auto", linears)
    # the copies (64 x 64 bf16, twice: 16 KiB) must fit in half the free memory
    monkeypatch.setattr(amx_linear, "amx_speedup", lambda: 1.8)
    monkeypatch.setattr(amx_linear, "available_memory_bytes", lambda: 2 * 16384 - 1)
    assert not amx_linear.amx_wanted(cpu, torch.bfloat16, "auto", linears)
    assert amx_linear.amx_wanted(cpu, torch.bfloat16, "amx", linears)  # the user's word wins


def test_without_amx_the_tiles_are_never_taken(monkeypatch, caplog):
    monkeypatch.setattr(amx_linear, "amx_kernel_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=amx_linear.__name__):
        assert not amx_linear.amx_wanted(torch.device("cpu"), torch.bfloat16, "amx", [])
        assert cpu_linear.linear_route(torch.device("cpu"), torch.bfloat16, bf16_route="amx") != "amx"
    assert "no AMX-BF16" in caplog.text


@needs_amx
def test_a_bf16_engine_on_amx_tiles_agrees_with_one_on_onednn(tiny_model):
    logits = {}
    for route in ("amx", "native"):
        kinds, logits[route] = linear_kernels.bf16_engine_logits(tiny_model, route, 2)
        assert ("AmxLinear" in kinds) is (route == "amx")
    for got, want in zip(logits["amx"], logits["native"]):
        assert torch.allclose(got, want, rtol=0.05, atol=0.05)  # bf16 sums in another order
