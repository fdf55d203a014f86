"""The CPU pool's K/V storage: it asks for transparent huge pages and starts zeroed."""

import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="transparent huge pages: Linux, not disabled",
)
def test_the_cpu_pool_asks_for_huge_pages_and_starts_zeroed():
    import torch

    from tokenfleet.kvcache.store import HUGE_PAGE, PagedKVStore, advise_huge_pages

    assert advise_huge_pages(torch.empty(HUGE_PAGE // 4, dtype=torch.uint8)) == 0  # no whole huge page
    big = torch.empty(8 * HUGE_PAGE, dtype=torch.uint8)
    assert 6 * HUGE_PAGE <= advise_huge_pages(big) <= 8 * HUGE_PAGE
    store = PagedKVStore(2, 512, 16, 4, 64, dtype=torch.bfloat16)  # 4 MiB a layer
    assert all(int(t.count_nonzero()) == 0 for t in store.k + store.v)
