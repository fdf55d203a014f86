"""``tokenfleet::lora_delta_`` (each row's LoRA update, rows grouped by adapter) against the same
sums in float64: decode-shaped batches (rows of many slots interleaved), prefill-shaped runs (its
GEMM route), slots whose adapter leaves the linear alone, a fused output's column offset, and
widths that are not multiples of the vector width."""

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
        [1] * 70 + [2] * 3 + [-1] * 3 + [0] * 20,  # prefill: a run long enough for the GEMMs
    ],
)
@pytest.mark.parametrize("in_out_offset", [(96, 64, 0), (100, 77, 23)])
def test_lora_delta_equals_the_sums_in_float64(dtype, rows, in_out_offset):
    in_features, out_features, offset = in_out_offset
    gen = torch.Generator().manual_seed(3)
    ranks = [8, 16, 0, 5]  # slot 2 leaves this linear alone
    shrink = [torch.randn(r, in_features, generator=gen).to(dtype) for r in ranks]
    expand = [torch.randn(r, out_features, generator=gen).mul(0.1).to(dtype) for r in ranks]
    shrink[2] = expand[2] = torch.empty(0, 0, dtype=dtype)
    scale = [0.5, 2.0, 0.0, 1.0]
    slots = torch.tensor(rows, dtype=torch.long)
    x = torch.randn(len(rows), in_features, generator=gen).to(dtype)
    y = torch.randn(len(rows), offset + out_features + 5, generator=gen).to(dtype)
    want = reference(y, x, shrink, expand, scale, slots, offset)
    torch.ops.tokenfleet.lora_delta_(y, x, shrink, expand, scale, slots, offset)
    # float32 sums, rounded once to the dtype (bf16's GEMM route rounds v and the delta as well)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(y.double(), want, **tol)
    untouched = [t for t, s in enumerate(rows) if s in (-1, 2)]
    assert torch.equal(y[untouched].double(), want[untouched])  # rows with no update keep theirs


def test_lora_delta_refuses_a_shrink_that_does_not_fit_the_input():
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"S must be \[r, in\]"):
        torch.ops.tokenfleet.lora_delta_(
            y, x, [torch.randn(4, 7)], [torch.randn(4, 8)], [1.0], torch.zeros(2, dtype=torch.long), 0
        )
