"""The C++ attention operators against SDPA on the same tensors: every prompt length (1 included),
grouped-query heads, head sizes the vector code splits differently, float32 and bfloat16, and the
K/V rows they write into the pool."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("kernels"),  # built (or loaded) when the first test runs
]

BLOCK = 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def causal_reference(q, k, v, rows: slice) -> torch.Tensor:
    """SDPA in float32 over one prompt's tokens: ``[1, heads, n, D]``."""
    q, k, v = (t[:, :, rows].float() for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def packed_prompts(lengths, heads, kv_heads, head_dim, dtype, seed=0, block=BLOCK):
    """Queries/keys/values laid end to end as the model hands them over ([1, heads, N, D] views of
    [1, N, heads, D]), a pool, and where each token's K/V go in it (each prompt in its own blocks)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def heads_view(h):
        return torch.randn(1, total, h, head_dim, generator=gen).to(dtype).transpose(1, 2)

    q, k, v = heads_view(heads), heads_view(kv_heads), heads_view(kv_heads)
    blocks = [(n + block - 1) // block for n in lengths]
    pool = torch.zeros(sum(blocks) + 1, block, kv_heads, head_dim, dtype=dtype)
    first = torch.cumsum(torch.tensor([0] + blocks[:-1]), 0)
    places = [(int(first[i]) + t // block, t % block) for i, n in enumerate(lengths) for t in range(n)]
    write_blocks = torch.tensor([b for b, _ in places], dtype=torch.long)
    write_offsets = torch.tensor([o for _, o in places], dtype=torch.long)
    return q, k, v, pool, pool.clone(), write_blocks, write_offsets


@pytest.mark.parametrize(
    "lengths, heads, kv_heads, head_dim, dtype",
    [
        ([5, 1, 17, 64], 4, 2, 64, torch.float32),
        ([128, 128, 3], 12, 12, 64, torch.bfloat16),
        ([300, 7], 8, 8, 128, torch.bfloat16),
        ([33, 2], 4, 1, 80, torch.float32),
        ([1], 2, 2, 16, torch.bfloat16),
        # the AMX tile path's blocks: 32 query rows, 64 keys; prompts on both sides of them
        ([65, 64, 31, 97, 2, 1], 8, 2, 64, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("tiles", [True, False])  # bf16 on AMX: tile path and register-blocked path
def test_prefill_operator_equals_sdpa_per_prompt(lengths, heads, kv_heads, head_dim, dtype, tiles):
    q, k, v, k_pool, v_pool, blocks, offsets = packed_prompts(lengths, heads, kv_heads, head_dim, dtype)
    starts = torch.cumsum(torch.tensor([0, *lengths]), 0)
    before = torch.ops.tokenfleet.prefill_tiles(tiles)
    try:
        out = torch.ops.tokenfleet.paged_prefill(
            q, k, v, k_pool, v_pool, blocks, offsets, starts, head_dim**-0.5
        )
    finally:
        torch.ops.tokenfleet.prefill_tiles(before)
    assert out.shape == (1, sum(lengths), heads, head_dim) and out.dtype == dtype
    for b, n in enumerate(lengths):
        rows = slice(int(starts[b]), int(starts[b]) + n)
        assert_close(out[:, rows], causal_reference(q, k, v, rows).transpose(1, 2), dtype)
    assert torch.equal(k_pool[blocks, offsets], k[0].transpose(0, 1))
    assert torch.equal(v_pool[blocks, offsets], v[0].transpose(0, 1))


@pytest.mark.parametrize(
    "prompts, heads, kv_heads, head_dim, dtype",
    [  # (tokens the pool holds already, tokens computed now) per prompt
        ([(16, 5), (0, 9), (48, 1), (32, 40)], 4, 2, 64, torch.float32),
        ([(128, 3), (64, 64), (16, 300)], 12, 12, 64, torch.bfloat16),
        ([(32, 33), (96, 31), (0, 65)], 8, 2, 64, torch.bfloat16),  # the AMX tiles' edges
        ([(16, 7), (48, 2)], 4, 1, 80, torch.float32),
    ],
)
@pytest.mark.parametrize("tiles", [True, False])
def test_prefill_after_a_cached_prefix_equals_sdpa_over_the_whole_prompt(
    prompts, heads, kv_heads, head_dim, dtype, tiles
):
    """Prompts whose first tokens' K/V are in the pool already (a cached prefix, read through each
    prompt's block table) and whose other tokens are packed: each packed query attends to the
    cached keys and to its own prompt's earlier packed ones, as SDPA over the whole prompt does."""
    totals = [c + n for c, n in prompts]
    q, k, v, k_pool, v_pool, blocks, offsets = packed_prompts(totals, heads, kv_heads, head_dim, dtype)
    starts = torch.cumsum(torch.tensor([0, *totals]), 0)
    cached_rows = torch.cat([torch.arange(int(s), int(s) + c) for s, (c, _) in zip(starts, prompts)])
    tail_rows = torch.cat([torch.arange(int(s) + c, int(s) + c + n) for s, (c, n) in zip(starts, prompts)])
    for pool, x in ((k_pool, k), (v_pool, v)):  # the cached tokens' K/V, where an earlier step wrote them
        pool[blocks[cached_rows], offsets[cached_rows]] = x[0].transpose(0, 1)[cached_rows]
    per_prompt = [sorted({int(b) for b in blocks[int(s) : int(s) + t]}) for s, t in zip(starts, totals)]
    width = max(map(len, per_prompt))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in per_prompt])
    tail_starts = torch.cumsum(torch.tensor([0, *(n for _, n in prompts)]), 0)
    before = torch.ops.tokenfleet.prefill_tiles(tiles)
    try:
        out = torch.ops.tokenfleet.paged_prefill(
            *(t[:, :, tail_rows] for t in (q, k, v)),
            k_pool,
            v_pool,
            blocks[tail_rows],
            offsets[tail_rows],
            tail_starts,
            head_dim**-0.5,
            tables,
            torch.tensor([c for c, _ in prompts]),
        )
    finally:
        torch.ops.tokenfleet.prefill_tiles(before)
    for b, (cached, _) in enumerate(prompts):
        whole = causal_reference(q, k, v, slice(int(starts[b]), int(starts[b + 1]))).transpose(1, 2)
        got = out[:, int(tail_starts[b]) : int(tail_starts[b + 1])]
        assert_close(got, whole[:, cached:], dtype)
    assert torch.equal(k_pool[blocks, offsets], k[0].transpose(0, 1))  # the tails written, the rest kept


@pytest.mark.parametrize(
    "lengths, heads, kv_heads, head_dim, dtype, block",
    [
        ([9, 1, 40], 4, 2, 64, torch.float32, BLOCK),
        ([9, 1, 40], 4, 2, 64, torch.bfloat16, BLOCK),
        # the vector code works on 16 tokens at a time: lengths on both sides of that
        ([15, 16, 31, 160], 12, 12, 64, torch.bfloat16, BLOCK),
        ([47, 3], 8, 2, 128, torch.bfloat16, BLOCK),
        # query heads per KV head whose sums the value pass keeps in registers (3: SmolLM2's),
        # and more than fit (8: the general path)
        ([15, 33, 70], 9, 3, 64, torch.bfloat16, BLOCK),
        ([40, 7], 16, 4, 64, torch.bfloat16, BLOCK),
        ([30, 17], 8, 1, 64, torch.bfloat16, BLOCK),
        ([20, 5], 4, 4, 80, torch.bfloat16, BLOCK),  # a head size the vector code leaves to the plain loops
        ([20, 5], 4, 4, 80, torch.float32, BLOCK),
        # float32 caches take the vector code too: SmolLM2's heads, head size 128, shuffled small blocks
        ([15, 16, 31, 160], 9, 3, 64, torch.float32, BLOCK),
        ([47, 3], 8, 2, 128, torch.float32, BLOCK),
        ([15, 16, 37, 70], 4, 2, 64, torch.float32, 4),
        # blocks smaller and larger than those 16 tokens, lying in the pool in shuffled order
        ([15, 16, 37, 70], 4, 2, 64, torch.bfloat16, 4),
        ([15, 16, 37, 70], 4, 2, 64, torch.bfloat16, 24),
    ],
)
def test_decode_operator_equals_sdpa_over_the_pool(lengths, heads, kv_heads, head_dim, dtype, block):
    """Sequences whose earlier tokens sit in the pool, one new token each."""
    totals = [n + 1 for n in lengths]
    q, k, v, k_pool, v_pool, blocks, offsets = packed_prompts(
        totals, heads, kv_heads, head_dim, dtype, block=block
    )
    if block != BLOCK:  # the same layout with every block moved to a random place in the pool
        move = torch.randperm(k_pool.shape[0], generator=torch.Generator().manual_seed(1))
        blocks = move[blocks]
    ends = torch.cumsum(torch.tensor(totals), 0)
    last = ends - 1  # each sequence's newest token: written and attended by the decode operator
    history = torch.cat([torch.arange(int(e) - n - 1, int(e) - 1) for e, n in zip(ends, lengths)])
    k_pool[blocks[history], offsets[history]] = k[0].transpose(0, 1)[history]
    v_pool[blocks[history], offsets[history]] = v[0].transpose(0, 1)[history]
    width = (max(totals) + block - 1) // block  # a table row per sequence, past its end unused
    starts = (ends - torch.tensor(totals)).tolist()
    tables = torch.stack(
        [
            torch.tensor([int(blocks[min(s + i * block, s + n - 1)]) for i in range(width)])
            for s, n in zip(starts, totals)
        ]
    )
    step = [t[0, :, last].transpose(0, 1)[:, :, None] for t in (q, k, v)]  # [B, heads, 1, D]
    out = torch.ops.tokenfleet.paged_decode(
        *step, k_pool, v_pool, blocks[last], offsets[last], tables, torch.tensor(totals), head_dim**-0.5
    )
    for b, n in enumerate(lengths):
        rows = slice(int(ends[b]) - n - 1, int(ends[b]))
        assert_close(out[b, 0], causal_reference(q, k, v, rows)[0, :, -1], dtype)


def test_an_installed_package_carries_every_kernel_source():
    """A non-editable install (the Dockerfile's ``pip install .``) ships only what package-data
    names: a header left out builds nowhere but in a checkout."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from tokenfleet.engines.native.kernels import build as kernel_build

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = globs["tokenfleet.engines.native.kernels"]
    package_dir = Path(kernel_build.__file__).parent
    for path in kernel_build.CSRC.iterdir():
        relative = path.relative_to(package_dir).as_posix()
        assert any(fnmatch.fnmatch(relative, glob) for glob in shipped), relative
    assert set(kernel_build.SOURCES + kernel_build.HEADERS) == set(kernel_build.CSRC.iterdir())
