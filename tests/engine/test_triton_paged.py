"""The Triton paged decode kernel against the gather + SDPA reference, on random pools with
scattered blocks, GQA ratios 1/3/4, head_dim 64 and a non-power-of-two one. On the CPU it runs in
Triton's interpreter; `TOKENFLEET_TEST_DEVICE=cuda` runs it compiled on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from conftest import TEST_DEVICE  # noqa: E402

from tokenfleet.engines.native.attention import triton_paged  # noqa: E402
from tokenfleet.engines.native.attention.torch_route import paged_attention_op  # noqa: E402
from tokenfleet.kvcache.store import PagedKVStore  # noqa: E402


@pytest.fixture
def kernel_device():
    """The device the kernel runs on: on the CPU, Triton's interpreter (conftest switches it on)."""
    if TEST_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before Triton is imported")
    return torch.device(TEST_DEVICE)


def reference(query, k_pool, v_pool, tables, lengths, scale):
    """Gather + masked SDPA: the engine's fallback path."""
    keys, values = PagedKVStore.gather(k_pool, v_pool, tables)
    key_pos = torch.arange(tables.shape[1] * k_pool.shape[1], device=query.device)
    mask = (key_pos[None, :] < lengths[:, None])[:, None, None, :]
    gqa = query.shape[1] != k_pool.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None], keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return out[:, :, 0]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype",
    [
        (4, 4, 64, torch.float32),
        (9, 3, 64, torch.float32),
        (8, 2, 48, torch.float32),
        (8, 2, 64, torch.bfloat16),
    ],
)
def test_the_kernel_reads_blocks_where_they_lie(kernel_device, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(heads * head_dim)
    block, blocks = 16, 40
    lengths = torch.tensor([1, 16, 17, 50, 5])  # one token, a full block, one over, several blocks
    width = -(-int(lengths.max()) // block)
    pool = torch.randn(2, blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    # each sequence's blocks scattered over the pool, the table padded with a stale block
    order = torch.randperm(blocks, generator=gen)
    tables = order[: len(lengths) * width].view(len(lengths), width)
    query = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    dev = kernel_device
    args = [t.to(dev) for t in (query, pool[0], pool[1], tables, lengths)]
    got = triton_paged.paged_decode(*args, scale=head_dim**-0.5)
    want = reference(*args, scale=head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_attention_op_writes_by_slot_then_attends_with_the_kernel(kernel_device):
    """The op's Triton route: the step's K/V go to their slots in one indexed copy each, and the
    new token attends to itself among its sequence's keys, as the gather route does."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block = 6, 2, 32, 16
    k_pool, v_pool = (torch.randn(12, block, kv_heads, head_dim, generator=gen) for _ in range(2))
    tables = torch.tensor([[3, 7], [0, 11], [5, 9]])
    lengths = torch.tensor([18, 2, 30])
    last = lengths - 1
    slots = tables[torch.arange(3), last // block] * block + last % block
    query = torch.randn(3, heads, 1, head_dim, generator=gen)
    key, value = (torch.randn(3, kv_heads, 1, head_dim, generator=gen) for _ in range(2))
    outs, pools = [], []
    for triton in (True, False):
        k, v = k_pool.clone(), v_pool.clone()
        key_pos = torch.arange(2 * block)
        mask = None if triton else (key_pos[None, :] < lengths[:, None])[:, None, None, :]
        outs.append(
            paged_attention_op(query, key, value, k, v, slots, mask, tables, lengths, 0.2, None, [], triton)
        )
        pools.append((k, v))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    written = pools[0][0].view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(written, key[:, :, 0])


COMPILE_FOR_HOPPER = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from tokenfleet.engines.native.attention import triton_paged
strides = ("qb", "qh", "block", "token", "head", "table", "ob", "oh")
signature = {
    **{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
    "tables_ptr": "*i64", "lengths_ptr": "*i64", "scale": "fp32",
    **{"stride_" + name: "i32" for name in strides},
    **{name: "constexpr" for name in ("GROUP", "BLOCK_SIZE", "HEAD_DIM", "DIM_POW2")},
}
constexprs = {"GROUP": 3, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "DIM_POW2": 64}
kernel = ASTSource(triton_paged.paged_decode_kernel, signature, constexprs)
print(len(compile(kernel, target=GPUTarget("cuda", 90, 32)).asm["cubin"]))
"""


def test_the_kernel_compiles_for_hopper_without_a_gpu():
    """The compiled path, which the interpreter skips, lowers to a cubin for sm_90 (the H200)
    with Triton's own ptxas: typing, loop-carried values and masks checked by the real compiler.
    In a process of its own, without the interpreter switch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 1000  # a cubin's bytes
