"""The CPU kernels (``csrc/``), built on first use.

Loading them registers the operators ``torch.ops.tokenfleet.paged_decode`` and
``torch.ops.tokenfleet.paged_prefill`` (write the step's K/V into the pool, attend), and
``pack_linear_bf16`` / ``linear_bf16`` (bf16 linears on AVX512-BF16, see ``cpu_linear``) and a
decoder layer's elementwise parts (``rms_norm``, ``add_rms_norm``, ``rotary_``, ``silu_and_mul``,
see ``decoder``), with
shape-only implementations here so that ``torch.compile`` can trace them. They are
compiled for this machine's CPU with the C++ compiler PyTorch finds (``torch.utils.cpp_extension``),
cached under ``~/.cache/tokenfleet/kernels/<cpu>``, and loaded once per process. When it cannot
be built (no compiler, no ``ninja``) or ``--no-paged-kernel`` turns it off, callers get ``None``
and fall back to gathering the blocks and calling SDPA: slower, same results.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenfleet.config.loading import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / "paged_decode_cpu.cpp",
    CSRC / "paged_prefill_cpu.cpp",
    CSRC / "linear_bf16_cpu.cpp",
    CSRC / "linear_f32_cpu.cpp",
    CSRC / "layer_ops_cpu.cpp",
]
HEADERS = [CSRC / "common.h", CSRC / "linear_tasks.h"]
CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-math-errno",  # lets the softmax's exp vectorize
]
_lock = threading.Lock()
_module: Any = None
_tried = False


def _cpu_tag() -> str:
    """A cache key for ``-march=native`` builds: a build is only reused on the same kind of CPU."""
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    except OSError:
        flags = platform.processor()
    import torch

    # what changes the binary: the CPU's ISA, torch and Python, the compiler flags, the sources
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = f"{flags}|{torch.__version__}|{sys.version_info[:2]}|{CFLAGS}|{code.hex()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def paged_attention_kernels(enabled: bool = True) -> Any:
    """The compiled extension module, or ``None`` when not ``enabled`` or it cannot be built."""
    global _module, _tried
    if not enabled:
        return None
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            from torch.utils.cpp_extension import load

            build_dir = build_directory()
            building = not kernels_built(build_dir)
            if building:
                log.info("building the CPU kernels: once per machine, ~1 min")
            else:
                log.info("loading the CPU kernels (built on this machine before)")
            ticks = "still building the CPU kernels" if building else None
            with build_lock(build_dir), progress_lines(ticks):
                _module = _load(load, build_dir)
            _register_fake()
        except Exception as e:  # no compiler, no ninja, an odd platform: the gather path still works
            log.warning("CPU paged-attention kernels unavailable (%s); using gather + SDPA", str(e)[:300])
            _module = None
        return _module


def kernels_built(build_dir: Path | None = None) -> bool:
    """Whether this machine already holds a build of these sources (loading takes a second)."""
    return ((build_dir or build_directory()) / "tokenfleet_paged_attention_cpu.so").exists()


def build_directory() -> Path:
    """Where this machine's build of these sources lives (made if missing)."""
    build_dir = cache_dir() / "kernels" / _cpu_tag()
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


PROGRESS_EVERY_S = 15.0


@contextlib.contextmanager
def progress_lines(what: str | None) -> Iterator[None]:
    """A log line every :data:`PROGRESS_EVERY_S` seconds while the block runs (``what``, and the
    seconds so far; ``None``: no lines), so a minute's build never looks like a hang."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            log.info("%s (%.0f s)", what, time.monotonic() - start)

    ticker = threading.Thread(target=tick, name="tokenfleet-progress", daemon=True) if what else None
    if ticker is not None:
        ticker.start()
    try:
        yield
    finally:
        done.set()


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """One builder per build directory at a time, by an OS file lock (released when its holder
    dies, however it dies). torch's own lock is a file that a killed build leaves behind, and
    every later worker then waited on it forever: holding ours, no live builder can be using
    that file, so a leftover one is removed."""
    with open(build_dir / ".tokenfleet-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(load: Any, build_dir: Path) -> Any:
    """torch's ``cpp_extension.load`` of our sources, built from copies inside the build
    directory: its ``build.ninja`` names absolute paths, and built from each checkout's own files
    a second checkout or virtualenv rebuilt everything (and two at once corrupted each other).
    The directory's key holds the sources' hash, so a copy already there is this code."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        copy = src / path.name
        if not copy.exists():
            partial = copy.with_name(f"{copy.name}.{os.getpid()}.tmp")
            partial.write_bytes(path.read_bytes())
            partial.replace(copy)
    return load(
        name="tokenfleet_paged_attention_cpu",
        sources=[str(src / path.name) for path in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def _register_fake() -> None:
    import torch

    @torch.library.register_fake("tokenfleet::paged_decode")
    def _(query, key, value, k_cache, v_cache, write_blocks, write_offsets, block_tables, lengths, scale):
        return query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])

    @torch.library.register_fake("tokenfleet::linear_bf16")
    def _(x, packed, out_features, bias):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("tokenfleet::linear_f32")
    def _(x, packed, out_features, bias):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("tokenfleet::paged_prefill")
    def _(query, key, value, k_cache, v_cache, write_blocks, write_offsets, starts, scale):
        return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
