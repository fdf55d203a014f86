"""Torch storage of the paged KV cache: one K and one V tensor per layer, indexed by block id.

Layout ``[num_blocks, block_size, kv_heads, head_dim]`` (token-major): a step's new K/V rows go in
without a transpose, a token's heads are one contiguous row (the CPU decode kernel streams them in
order), and one ``index_select`` of a sequence's blocks is already its keys in token order (the
gather fallback reads them through a transposed view: one copy, not two).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys
import threading
import time

import torch

from tokenfleet.config.cpus import become_side_work

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+: fault pages in writable, data untouched
POPULATE_CHUNK = 64 * 2**20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask Linux to back a CPU tensor with 2 MiB pages (transparent huge pages, which hosts often
    enable in ``madvise`` mode only); call it before the memory is first written. The decode
    kernel reads each sequence's blocks from anywhere in the pool, and with 4 KiB pages many of
    those reads begin with a TLB miss. Best effort; returns the bytes advised (0 off Linux, or
    when refused)."""
    libc = _libc() if sys.platform.startswith("linux") and tensor.device.type == "cpu" else None
    if libc is None:
        return 0
    begin = tensor.data_ptr()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the tensor only
    end = (begin + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start or libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE):
        return 0
    return end - start


class PagedKVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self._maps: list[mmap.mmap] = []  # the CPU pool's memory, kept alive with the tensors
        self.k = [self._allocate(shape, device, dtype) for _ in range(num_layers)]
        self.v = [self._allocate(shape, device, dtype) for _ in range(num_layers)]

    def _allocate(
        self, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype
    ) -> torch.Tensor:
        """Zeros. On the CPU from an anonymous mapping, which the kernel fills with zeros as each
        page is first written: a pool sized for a long cache costs memory only as it fills,
        whatever malloc the process runs on."""
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, device=device, dtype=dtype)
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: THP applies
        self._maps.append(memory)
        tensor = torch.frombuffer(memory, dtype=dtype).view(shape)
        advise_huge_pages(tensor)  # before the first write: pages are chosen then
        return tensor

    def populate_in_background(self) -> threading.Thread | None:
        """Fault the CPU pool's pages in on a thread of low priority (nice 19: the kernel's page
        zeroing and huge-page compaction yield to serving), so that steps never stall on a first
        touch, and the cache growing into fresh blocks costs nothing. ``MADV_POPULATE_WRITE``
        leaves the data alone: safe while steps write K/V. None where there is nothing to do
        (not the CPU, or not Linux 5.14+)."""
        libc = _libc() if sys.platform.startswith("linux") and self._maps else None
        if libc is None:
            return None
        regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in self.k + self.v]
        stop = threading.Event()

        def populate() -> None:
            become_side_work(niceness=19)
            started = time.monotonic()
            for begin, size in regions:
                for offset in range(0, size, POPULATE_CHUNK):
                    if stop.is_set():
                        return
                    length = min(POPULATE_CHUNK, size - offset)
                    if libc.madvise(
                        ctypes.c_void_p(begin + offset), ctypes.c_size_t(length), MADV_POPULATE_WRITE
                    ):
                        return  # not supported here: pages come in on first touch
            log.info("KV pool resident: %.0f MiB in %.1f s", self.nbytes / 2**20, time.monotonic() - started)

        thread = threading.Thread(target=populate, name="tokenfleet-kv-populate", daemon=True)
        thread.start()

        def finish() -> None:  # a daemon thread still paging in at exit can abort the interpreter
            stop.set()
            thread.join(timeout=5)

        atexit.register(finish)
        return thread

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """K and V of every layer for one block of tokens."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * block_size * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def gather(
        k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of each sequence in ``block_tables`` ``[B, max_blocks]``, read from one layer's pool
        tensors ``[blocks, block, kv_heads, head_dim]``, as ``[B, kv_heads, max_blocks * block_size,
        head_dim]``: one copy each, returned as transposed views (slots past a sequence's length
        hold stale data: mask them)."""
        batch, nblocks = block_tables.shape
        _, block_size, kv_heads, head_dim = k_cache.shape
        flat = block_tables.reshape(-1)

        def take(store: torch.Tensor) -> torch.Tensor:
            tokens = store.index_select(0, flat).view(batch, nblocks * block_size, kv_heads, head_dim)
            return tokens.transpose(1, 2)

        return take(k_cache), take(v_cache)
