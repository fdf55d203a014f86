"""``tokenfleet::lora_delta_`` (each row's LoRA update, rows grouped by adapter) against the same
sums in float64: decode-shaped batches (rows of many slots interleaved), prefill-shaped runs (a
slot's rows in several pieces), slots whose adapter leaves the linear alone, a fused output's
parts (each at its column offset, in one call), and widths that are not multiples of the vector
width."""

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("kernels")]


def reference(y, x, shrink, expand, scale, rows, offset):
    out = y.double().clone()
    for t, s in enumerate(rows.tolist()):
        if s < 0 or not shrink[s].numel():
            continue
        delta = scale[s] * (shrink[s].double() @ x[t].double()) @ expand[s].double()
        out[t, offset : offset + delta.numel()] += delta
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows",
    [
        [0, 1, 2, 3, -1, 0, 1, 2, 3, 2, -1, 1],  # decode: one row per sequence, slots interleaved
        [1] * 70 + [2] * 3 + [-1] * 3 + [0] * 20,  # prefill: a slot's run longer than a piece
    ],
)
@pytest.mark.parametrize(
    "in_features, outs, offsets",
    [(96, [64], [0]), (100, [77], [23]), (100, [40, 24, 24], [0, 40, 64])],  # the last: a fused q/k/v
    ids=["plain", "offset", "fused"],
)
def test_lora_delta_equals_the_sums_in_float64(dtype, rows, in_features, outs, offsets):
    gen = torch.Generator().manual_seed(3)
    shrink, expand, scale = [], [], []
    for p, out_features in enumerate(outs):
        ranks = [8, 16, 0, 5] if p % 2 == 0 else [4, 0, 0, 12]  # a rank 0: that slot leaves it alone
        shrink += [
            torch.randn(r, in_features, generator=gen).to(dtype) if r else torch.empty(0, 0, dtype=dtype)
            for r in ranks
        ]
        expand += [
            torch.randn(r, out_features, generator=gen).mul(0.1).to(dtype)
            if r
            else torch.empty(0, 0, dtype=dtype)
            for r in ranks
        ]
        scale += [0.5, 2.0, 0.0, 1.0]
    slots = torch.tensor(rows, dtype=torch.long)
    x = torch.randn(len(rows), in_features, generator=gen).to(dtype)
    y = torch.randn(len(rows), offsets[-1] + outs[-1] + 5, generator=gen).to(dtype)
    want = y.double()
    for p, offset in enumerate(offsets):
        part = slice(4 * p, 4 * p + 4)
        want = reference(want, x, shrink[part], expand[part], scale[part], slots, offset)
    torch.ops.tokenfleet.lora_delta_(y, x, shrink, expand, scale, slots, offsets)
    # float32 sums, rounded once to the dtype (bf16 on AVX512-BF16: the shrink's products in pairs)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(y.double(), want, **tol)
    untouched = [t for t, s in enumerate(rows) if s in (-1, 2)]
    assert torch.equal(y[untouched].double(), want[untouched])  # rows with no update keep theirs


def test_lora_delta_refuses_a_shrink_that_does_not_fit_the_input():
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"S must be \[r, in\]"):
        torch.ops.tokenfleet.lora_delta_(
            y, x, [torch.randn(4, 7)], [torch.randn(4, 8)], [1.0], torch.zeros(2, dtype=torch.long), [0]
        )
