"""tokenfleet's float32 linear kernel: outputs as close to the exact products as MKL's, any shape
(partial tiles and panels, a bias, leading dimensions); the weight replaced by its packed copy, a
tied head given its own; inside a compiled graph; chosen by a measurement or by the switch; an
engine on it greedy-decodes as one on oneDNN does."""

import logging

import linear_kernels
import pytest
import torch
import torch.nn.functional as F
from conftest import make_runner
from linear_kernels import AGREEMENT_PROMPTS
from torch import nn

from tokenfleet.config import EngineConfig
from tokenfleet.engines.native.linear import f32 as f32_linear
from tokenfleet.engines.native.linear.f32 import F32KernelLinear, f32_kernel_wanted
from tokenfleet.engines.native.linear.routes import linear_route, pack_linears

CPU = torch.device("cpu")


needs_kernel = linear_kernels.needs_kernel(
    f32_linear.f32_kernel_available, "tokenfleet::linear_f32 needs a CPU with AVX-512 or AVX2"
)


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "rows, in_features, out_features",
    [
        (1, 96, 80),  # one row; a second panel of 32 of its 48 columns (AVX-512)
        (7, 50, 20),  # AVX2: a tile of 6 rows and one of 1; a panel of 16 columns and one of 4
        (3, 40, 25),  # a last panel of 25 columns: one vector and a masked one
        (9, 130, 100),  # a full tile of 8 rows and one more; a last panel of 4 columns
        (32, 576, 960),  # SmolLM2's q/k/v projection at a decode batch
        (40, 96, 144),  # 3 panels on 2 threads: the rows split in two shares instead
        (13, 33, 16),  # an odd number of input features, one vector of columns
        (400, 64, 64),  # more rows than one task takes (192)
    ],
)
def test_the_float32_kernel_sums_as_closely_as_mkl(bias, rows, in_features, out_features):
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(2, rows, in_features)  # a leading batch dimension, as HF passes
    with torch.inference_mode():
        native = linear(x)
        got = F32KernelLinear(linear)(x)
    assert got.dtype is torch.float32 and got.shape == (2, rows, out_features)
    exact = F.linear(
        x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double()
    )
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    # float32 sums in order: as near the exact value as MKL's blocked sums (a sum's bound, K * eps)
    assert (got.double() - exact).abs().max() <= (native.double() - exact).abs().max() * 4 + 1e-6


@needs_kernel
def test_the_float32_kernel_is_exact_on_exact_sums_and_keeps_nan_and_inf():
    torch.manual_seed(1)
    linear = nn.Linear(80, 100, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-8, 9, (100, 80)))
        linear.bias.copy_(torch.randint(-300, 301, (100,)))
    x = torch.randint(-8, 9, (9, 80)).float()
    x[7, 3], x[8, 5] = float("nan"), float("inf")
    with torch.inference_mode():
        got = F32KernelLinear(linear)(x)
    assert torch.equal(
        got[:7], F.linear(x[:7].double(), linear.weight.double(), linear.bias.double()).float()
    )
    assert got[7].isnan().all()
    assert (got[8].isinf() | got[8].isnan()).all()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, 50, bias=False)
        self.out = nn.Linear(50, 16, bias=False)
        self.tied = nn.Linear(16, 50, bias=False)
        self.tied.weight = self.embed.weight

    def forward(self, ids):
        return self.tied(self.out(self.head(torch.relu(self.proj(self.embed(ids))))))


@needs_kernel
def test_the_float32_kernel_replaces_the_weights_and_runs_inside_a_compiled_graph():
    torch.manual_seed(0)
    model = Tiny().eval()
    model.half_precision = nn.Linear(4, 4).to(torch.bfloat16)  # not float32: left alone
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        expected = model(ids)
        assert pack_linears(model, F32KernelLinear) == 4  # proj, head, out and the tied one
        eager = model(ids)
        compiled = torch.compile(model, fullgraph=True)(ids)
    assert isinstance(model.proj, F32KernelLinear) and isinstance(model.half_precision, nn.Linear)
    assert isinstance(model.embed.weight, nn.Parameter)  # the input embedding keeps the tied weight
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
    assert torch.equal(compiled, eager)
    assert torch.allclose(eager, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_routes_are_timed_against_onednn_or_f_linear():
    from tokenfleet.engines.native.linear.onednn import PackedLinear

    for rival in (PackedLinear, lambda m: m):
        speeds = f32_linear.f32_linear_speeds(rival, size=64, weights=2, rounds=1)
        assert set(speeds) == {"kernel", "rival"}
        assert all(len(t) == 2 and all(s > 0 for s in t) for t in speeds.values())


@needs_kernel
def test_auto_takes_the_float32_kernel_only_where_it_measures_faster(monkeypatch, caplog):
    def speeds(kernel, rival):
        monkeypatch.setattr(
            f32_linear, "f32_linear_speeds", lambda *a, **k: {"kernel": kernel, "rival": rival}
        )

    speeds((0.8, 1.0), (1.0, 1.0))  # as on a Zen 4 EPYC: faster at 32 rows, level at 512
    with caplog.at_level(logging.INFO, logger=f32_linear.__name__):
        assert f32_kernel_wanted(CPU, torch.float32, "auto", onednn=True)
    assert "1.25x oneDNN at 32 rows and 1.00x at 512: taken" in caplog.text
    assert linear_route(CPU, torch.float32) == "kernel"
    speeds((0.8, 1.1), (1.0, 1.0))  # a tenth slower at prefill rows: not worth it
    assert not f32_kernel_wanted(CPU, torch.float32, "auto", onednn=True)
    assert linear_route(CPU, torch.float32) == "float32"
    speeds((1.1, 1.0), (1.0, 1.0))  # slower at decode rows
    assert not f32_kernel_wanted(CPU, torch.float32, "auto", onednn=False)
    assert linear_route(CPU, torch.float32, onednn=False) == "native"
    # the switch decides without measuring; bf16 and other devices never take it
    monkeypatch.setattr(
        f32_linear, "f32_linear_speeds", lambda *a, **k: pytest.fail("timed despite the switch")
    )
    assert f32_kernel_wanted(CPU, torch.float32, "kernel", onednn=True)
    assert linear_route(CPU, torch.float32, f32_route="onednn") == "float32"
    assert linear_route(CPU, torch.float32, f32_route="native") == "native"
    assert not f32_kernel_wanted(CPU, torch.bfloat16, "kernel", onednn=True)
    assert not f32_kernel_wanted(torch.device("cuda"), torch.float32, "kernel", onednn=True)


def test_without_avx512_or_avx2_the_float32_kernel_is_never_taken(monkeypatch, caplog):
    monkeypatch.setattr(f32_linear, "f32_kernel_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=f32_linear.__name__):
        assert not f32_kernel_wanted(CPU, torch.float32, "kernel", onednn=True)
    assert "lacks AVX-512 and AVX2" in caplog.text
    assert not f32_kernel_wanted(CPU, torch.float32, "auto", onednn=True)


def test_the_switch_refuses_typos():
    assert EngineConfig().f32_linear == "auto"
    with pytest.raises(ValueError, match="f32_linear"):
        EngineConfig(f32_linear="fp32")


@needs_kernel
def test_a_float32_engine_on_the_kernel_decodes_as_one_on_onednn(tiny_model):

    tokens, logits = {}, {}
    for route in ("kernel", "onednn"):
        runner = make_runner(tiny_model, device="cpu", dtype="float32", f32_linear=route)
        kinds = {type(m).__name__ for m in runner.model.modules()}
        assert ("F32KernelLinear" in kinds) is (route == "kernel")
        tokens[route], logits[route] = linear_kernels.greedy_steps(runner, AGREEMENT_PROMPTS, 8)
    assert tokens["kernel"] == tokens["onednn"]
    for a, b in zip(logits["kernel"], logits["onednn"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("out_features", [144, 576, 688])
def test_the_linear_kernels_give_the_same_bits_on_one_thread_as_on_several(out_features):
    # a decode batch over an odd number of panels is split by rows instead: each output's sum is
    # still one thread's, in the same order
    from tokenfleet.engines.native.linear.bf16 import KernelLinear

    torch.manual_seed(out_features)
    linear = nn.Linear(96, out_features)
    x = torch.randn(40, 96)
    kernels = [(F32KernelLinear(linear), x), (KernelLinear(linear.to(torch.bfloat16)), x.to(torch.bfloat16))]
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for kernel, rows in kernels:
            several = kernel(rows)
            torch.set_num_threads(1)
            try:
                one = kernel(rows)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(one, several)
