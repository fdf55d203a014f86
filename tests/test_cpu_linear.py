"""float32 linears on oneDNN with prepacked weights: same outputs as ``F.linear``, no second copy
of a weight, a tied output embedding left alone."""

import pytest
import torch
from torch import nn

from tokenfleet.worker.cpu_linear import PackedLinear, onednn_linears_wanted, pack_linears

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
def test_packed_model_matches_and_tied_weights_stay(tie):
    torch.manual_seed(0)
    model = Tiny(tie).eval()
    ids = torch.randint(0, 50, (3, 7))
    with torch.inference_mode():
        expected = model(ids)
        swapped = pack_linears(model)
        got = model(ids)
    assert swapped == (2 if tie else 3)
    assert isinstance(model.proj, PackedLinear) and isinstance(model.down, PackedLinear)
    assert isinstance(model.head, nn.Linear) is tie
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    # the original weights are gone: the packed buffer is the only copy
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())


def test_only_float32_on_the_cpu_and_the_switch_turns_it_off(monkeypatch):
    cpu = torch.device("cpu")
    assert onednn_linears_wanted(cpu, torch.float32)
    assert not onednn_linears_wanted(cpu, torch.bfloat16)
    assert not onednn_linears_wanted(torch.device("cuda"), torch.float32)
    monkeypatch.setenv("TOKENFLEET_ONEDNN_LINEAR", "0")
    assert not onednn_linears_wanted(cpu, torch.float32)


def test_bf16_linears_are_left_alone():
    model = Tiny(False).to(torch.bfloat16)
    assert pack_linears(model) == 0
