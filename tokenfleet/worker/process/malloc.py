"""The worker's memory allocator, arranged by the worker itself rather than by the user's shell.

A decode step allocates and frees the same large buffers every few milliseconds. glibc's malloc
hands big blocks back to the kernel and faults them in again (page faults on every step, step
times swinging at batch 8-32); tcmalloc keeps them. So under ``--allocator auto`` a worker that
finds tcmalloc re-executes itself once with it in ``LD_PRELOAD`` (an allocator cannot be swapped
after start-up); without tcmalloc it raises glibc's mmap and trim thresholds instead, which keeps
those buffers in the heap. ``--allocator system`` leaves the process as started.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ARRANGED = "TOKENFLEET_ALLOCATOR_ARRANGED"  # set on the re-executed process: never loop
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")  # a user's own preload is theirs to keep
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap, not mmap
TRIM_THRESHOLD = 1 << 30  # free heap kept up to 1 GiB instead of handed back


def find_tcmalloc() -> str | None:
    """The path of a tcmalloc shared library on this machine, if any."""
    for directory in LIBRARY_DIRS:
        for name in TCMALLOC_NAMES:
            if (Path(directory) / name).exists():
                return str(Path(directory) / name)
    return ctypes.util.find_library("tcmalloc_minimal")


def arrange(choice: str, argv: list[str] | None = None) -> None:
    """Put this worker process on the allocator ``choice`` asks for; may re-execute the process
    (``argv``: what to run again, default this ``tokenfleet`` command line) and so never return."""
    if choice == "system" or os.environ.get(ARRANGED):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in PRELOADED):
        return
    tcmalloc = find_tcmalloc()
    if tcmalloc is None:
        if choice == "tcmalloc":
            raise ValueError("--allocator tcmalloc: no tcmalloc here (apt install libtcmalloc-minimal4)")
        tune_glibc()
        return
    env = {**os.environ, "LD_PRELOAD": f"{tcmalloc}:{preload}".rstrip(":"), ARRANGED: tcmalloc}
    argv = argv or [sys.executable, "-m", "tokenfleet", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)


def tune_glibc() -> bool:
    """Keep large freed blocks in glibc's heap (no mmap/munmap and page faults per step)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    os.environ[ARRANGED] = "glibc"
    return bool(ok)


def describe() -> str:
    """One log line's worth: which allocator this process runs on, and how to change it."""
    arranged = os.environ.get(ARRANGED)
    if arranged and arranged != "glibc" and not tcmalloc_loaded():
        return f"allocator: the system's ({arranged} failed to preload; --allocator system to stop trying)"
    if arranged == "glibc":
        return "allocator: glibc, thresholds raised (no tcmalloc here: apt install libtcmalloc-minimal4)"
    if arranged:
        return f"allocator: tcmalloc ({arranged}, preloaded by the worker; --allocator system to opt out)"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in PRELOADED):
        return f"allocator: as preloaded by LD_PRELOAD ({preload})"
    return "allocator: the system's (--allocator system)"


def tcmalloc_loaded() -> bool:
    """Whether tcmalloc is mapped into this process (Linux; False where that cannot be read)."""
    try:
        return "tcmalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False
