"""Linears on oneDNN float32 GEMMs with prepacked weights: float32 outputs equal ``F.linear``'s;
bf16 outputs equal a float32 GEMM of the same bf16 numbers, rounded to bf16; no second copy of a
weight; a tied output embedding left alone; bf16 routed by a measurement or by the switch."""

import logging

import linear_kernels
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenfleet.config import EngineConfig
from tokenfleet.engines.native.linear import bf16 as bf16_linear
from tokenfleet.engines.native.linear import routes as cpu_linear
from tokenfleet.engines.native.linear.onednn import PackedLinear
from tokenfleet.engines.native.linear.routes import onednn_linears_wanted, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


class Tiny(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16, bias=False)
        self.head = nn.Linear(16, 50, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.down(torch.relu(self.proj(self.embed(ids)))))


@pytest.mark.parametrize("tie", [True, False])
def test_packed_model_matches_and_a_tied_head_gets_a_packed_copy_of_its_own(tie):
    torch.manual_seed(0)
    model = Tiny(tie).eval()
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        expected = model(ids)
        swapped = pack_linears(model)
        got = model(ids)
    assert swapped == 3
    assert all(isinstance(m, PackedLinear) for m in (model.proj, model.down, model.head))
    assert isinstance(model.embed.weight, nn.Parameter)  # the input embedding keeps the weight
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    # the original weights are gone: the packed buffer is the only copy
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_a_bf16_linear_computes_the_bf16_products_in_float32_and_rounds_once(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        # the same numbers widened (exactly) to float32, float32 sums, one rounding at the end
        reference = F.linear(
            x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
        ).to(torch.bfloat16)
        native = linear(x)
        got = PackedLinear(linear)(x)
    assert got.dtype is torch.bfloat16 and got.shape == (rows, 80)
    # summation order may differ from MKL's in the last float32 bits: at most one bf16 step apart
    assert torch.allclose(got.float(), reference.float(), rtol=2**-7, atol=1e-6)
    # and as close to the exact result as a native bf16 GEMM is
    bias = None if linear.bias is None else linear.bias.double()
    exact = F.linear(x.double(), linear.weight.double(), bias)
    assert (got.double() - exact).abs().max() <= (native.double() - exact).abs().max() * 1.5 + 1e-6


def test_float32_always_on_the_cpu_and_the_switch_turns_it_off():
    cpu = torch.device("cpu")
    assert onednn_linears_wanted(cpu, torch.float32)
    assert not onednn_linears_wanted(cpu, torch.float16)
    assert not onednn_linears_wanted(torch.device("cuda"), torch.float32)
    assert not onednn_linears_wanted(torch.device("cuda"), torch.bfloat16)
    assert not onednn_linears_wanted(cpu, torch.float32, onednn=False)
    assert not onednn_linears_wanted(cpu, torch.bfloat16, route="float32", onednn=False)


def test_bf16_takes_float32_gemms_where_they_measure_faster(monkeypatch, caplog):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "bf16_matmul_speed", lambda: 0.6)
    with caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        assert onednn_linears_wanted(cpu, torch.bfloat16)
    assert "0.60x float32" in caplog.text and "--bf16-linear native" in caplog.text
    monkeypatch.setattr(cpu_linear, "bf16_matmul_speed", lambda: 1.9)
    assert not onednn_linears_wanted(cpu, torch.bfloat16)


def test_bf16_stays_on_bf16_gemms_when_float32_weights_would_not_fit(monkeypatch, caplog):
    cpu, model = torch.device("cpu"), Tiny(False).to(torch.bfloat16)
    extra = 2 * (16 * 32 + 32 * 16 + 16 * 50)  # bytes the float32 copies of the 3 linears add
    monkeypatch.setattr(cpu_linear, "bf16_matmul_speed", lambda: 0.6)
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 2 * extra)
    assert onednn_linears_wanted(cpu, torch.bfloat16, model)
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 2 * extra - 1)
    with caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        assert not onednn_linears_wanted(cpu, torch.bfloat16, model)
    assert "stay on bf16 GEMMs" in caplog.text
    assert onednn_linears_wanted(cpu, torch.bfloat16, model, route="float32")  # the user's word wins


def test_the_bf16_switch_overrides_the_measurement_and_refuses_typos(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "bf16_matmul_speed", lambda: pytest.fail("timed despite the switch"))
    assert not onednn_linears_wanted(cpu, torch.bfloat16, route="native")
    assert onednn_linears_wanted(cpu, torch.bfloat16, route="float32")
    with pytest.raises(ValueError, match="bf16_linear"):
        EngineConfig(bf16_linear="fp32")


def test_bf16_and_float16_models_pack_only_what_oneDNN_float32_can_hold():
    bf16 = Tiny(False).to(torch.bfloat16)
    assert pack_linears(bf16) == 3 and bf16.proj.packed_weight.dtype is torch.float32
    half = Tiny(False).to(torch.float16)
    assert pack_linears(half) == 0


# -- tokenfleet's own bf16 kernel (VDPBF16PS with AVX512-BF16, float32 FMAs with AVX-512 or AVX2) --


needs_kernel = linear_kernels.needs_kernel(
    bf16_linear.bf16_kernel_available, "tokenfleet::linear_bf16 needs a CPU with AVX-512 or AVX2"
)


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "rows, in_features, out_features",
    [
        (1, 96, 80),  # one row; fewer columns than a 64-column panel holds past the first
        (3, 40, 25),  # a last panel of 9 columns (AVX2's 16-column panels: one vector and a bit)
        (7, 130, 100),  # a partial tile of 6 rows; a last panel of 36 columns
        (32, 256, 688),  # the tiny model's MLP at a decode batch
        (13, 33, 320),  # an odd number of input features: the pack pads a zero column
        (400, 64, 64),  # more rows than one task takes (192)
    ],
)
def test_the_bf16_kernel_rounds_float32_sums_of_the_bf16_products_once(bias, rows, in_features, out_features):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, in_features).to(torch.bfloat16)  # a leading batch dimension, as HF passes
    with torch.inference_mode():
        native = linear(x)
        got = bf16_linear.KernelLinear(linear)(x)
    assert got.dtype is torch.bfloat16 and got.shape == (2, rows, out_features)
    bias = None if linear.bias is None else linear.bias.double()
    exact = F.linear(x.double(), linear.weight.double(), bias)
    # float32 sums in another order than oneDNN's: at most one bf16 step from the rounded exact value
    assert torch.allclose(got.double(), exact.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-6)
    assert (got.double() - exact).abs().max() <= (native.double() - exact).abs().max() * 1.5 + 1e-6


@needs_kernel
@pytest.mark.parametrize("rows", [12, 16, 20, 32])  # 2, 2, 3 and 4+ full tiles share the prefetch
def test_prefetching_the_next_panel_changes_no_bit(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(200, 64 * 5 + 7, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 200).to(torch.bfloat16)
    kernel = bf16_linear.KernelLinear(linear)
    ops = torch.ops.tokenfleet
    with torch.inference_mode():
        before = ops.linear_prefetch(True)
        try:
            fetched = kernel(x)
            ops.linear_prefetch(False)
            plain = kernel(x)
        finally:
            ops.linear_prefetch(before)
    assert torch.equal(fetched, plain)


@needs_kernel
def test_the_bf16_kernel_rounds_exact_sums_to_nearest_even_and_keeps_nan_and_inf():
    # Small integers: every product and sum is exact in float32, so only the final rounding to
    # bf16 (8 significant bits: 257 -> 256, 259 -> 260, ties to even) decides the output.
    torch.manual_seed(1)
    linear = nn.Linear(80, 100, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-8, 9, (100, 80)))
        linear.bias.copy_(torch.randint(-300, 301, (100,)))
    linear = linear.to(torch.bfloat16)
    x = torch.randint(-8, 9, (9, 80)).to(torch.bfloat16)
    x[7, 3], x[8, 5] = float("nan"), float("inf")
    with torch.inference_mode():
        got = bf16_linear.KernelLinear(linear)(x)
    exact = F.linear(x[:7].double(), linear.weight.double(), linear.bias.double())
    assert exact.abs().max() < 2**24 and torch.equal(got[:7], exact.to(torch.bfloat16))
    assert got[7].isnan().all()  # NaN times anything, summed: NaN in every column
    assert (got[8].isinf() | got[8].isnan()).all()  # inf times a weight: +-inf, or NaN where it is 0


@needs_kernel
def test_the_bf16_kernel_replaces_the_weight_and_runs_inside_a_compiled_graph():
    torch.manual_seed(0)
    model = Tiny(tie=True).to(torch.bfloat16).eval()
    model.extra = nn.Linear(16, 16).to(torch.float32)  # not bf16: left to the other routes
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        expected = model(ids)
        assert pack_linears(model, bf16_linear.KernelLinear) == 3  # proj, down and the tied head
        eager = model(ids)
        compiled = torch.compile(model, fullgraph=True)(ids)
    assert isinstance(model.proj, bf16_linear.KernelLinear) and isinstance(model.extra, nn.Linear)
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
    assert torch.equal(compiled, eager)
    assert torch.allclose(eager.float(), expected.float(), rtol=0.05, atol=0.05)


@needs_kernel
def test_the_routes_are_timed_on_any_cpu_the_kernel_runs_on():
    # on AVX2-only CPUs oneDNN has no bf16 linear to prepack for: the library's matmul stands in
    speeds = bf16_linear.bf16_linear_speeds(size=64, weights=2, rounds=1)
    assert set(speeds) == {"kernel", "native", "float32"}
    assert all(len(t) == 2 and all(s > 0 for s in t) for t in speeds.values())


def fixed_speeds(kernel, native, float32=(1.0, 1.0)):
    return lambda: {"kernel": kernel, "native": native, "float32": float32}


@needs_kernel
def test_auto_takes_the_bf16_kernel_only_where_it_measures_fastest(monkeypatch, caplog):
    cpu = torch.device("cpu")
    # as on a Zen 4 EPYC: faster at 32 rows, level at 512
    monkeypatch.setattr(cpu_linear, "bf16_linear_speeds", fixed_speeds((0.8, 0.5), (1.0, 0.5)))
    with caplog.at_level(logging.INFO, logger="tokenfleet.engines.native.linear.routes"):
        assert cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16)
    assert "1.25x the fastest oneDNN GEMM" in caplog.text and "taken" in caplog.text
    # as on an AMX Xeon: oneDNN's tiles four times faster on prefill rows
    monkeypatch.setattr(cpu_linear, "bf16_linear_speeds", fixed_speeds((0.8, 2.0), (1.0, 0.5)))
    assert not cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16)
    assert not cpu_linear.bf16_kernel_wanted(cpu, torch.float32)
    # against the float32 route (twice the weight bytes) a prefill up to a fifth slower is taken,
    # as on an Ice Lake-class Xeon, whose emulated bf16 GEMM is the slowest of the three
    monkeypatch.setattr(cpu_linear, "bf16_linear_speeds", fixed_speeds((0.8, 1.15), (4.0, 10.0), (1.0, 1.0)))
    assert cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "bf16_linear_speeds", fixed_speeds((0.8, 1.3), (4.0, 10.0), (1.0, 1.0)))
    assert not cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16)
    # ... but no slower than 0.95x where the fastest at prefill keeps bf16 weights
    monkeypatch.setattr(cpu_linear, "bf16_linear_speeds", fixed_speeds((0.8, 1.15), (1.0, 1.0), (1.0, 2.0)))
    assert not cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16)
    # the switch decides without measuring
    assert cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16, "kernel")
    monkeypatch.setattr(cpu_linear, "bf16_linear_speeds", fixed_speeds((0.1, 0.1), (1.0, 1.0)))
    assert not cpu_linear.bf16_kernel_wanted(cpu, torch.bfloat16, "native")


def test_without_avx512_or_avx2_the_kernel_is_never_taken(monkeypatch, caplog):
    monkeypatch.setattr(cpu_linear, "bf16_kernel_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.engines.native.linear.routes"):
        assert not cpu_linear.bf16_kernel_wanted(torch.device("cpu"), torch.bfloat16, "kernel")
    assert "lacks AVX-512 and AVX2" in caplog.text


@needs_kernel
def test_a_bf16_engine_on_the_kernel_agrees_with_one_on_onednn(tiny_model):
    logits = {}
    for route in ("kernel", "native"):
        kinds, logits[route] = linear_kernels.bf16_engine_logits(tiny_model, route, 1)
        assert ("KernelLinear" in kinds) is (route == "kernel")
    for got, want in zip(logits["kernel"], logits["native"]):
        assert torch.allclose(got, want, rtol=0.05, atol=0.05)  # bf16 sums in another order
