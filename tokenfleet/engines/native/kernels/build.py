"""Building the CPU kernels (``csrc/``): once per machine and CPU kind, into
``<cache>/kernels/<key>``, where the key holds everything that changes the binary (the CPU's
instruction sets, torch's and Python's versions, the flags, the sources' bytes) and nothing that
does not (not the virtualenv, not the checkout); the sources are compiled from copies inside that
directory. A finished build is marked and from then on loaded directly, never handed to ninja
again (torch writes the venv's include paths into the build file: run through it, every other
virtualenv rebuilt everything). Builds are looked for in this process's cache home and in the
user's default one, so a test with a cache home of its own or a second virtualenv compiles
nothing. One builder per directory at a time; the others wait, with progress lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tokenfleet.config.loading import kernel_cache_dirs

log = logging.getLogger(__name__)

NAME = "tokenfleet_paged_attention_cpu"
CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / "paged_decode_cpu.cpp",
    CSRC / "paged_prefill_cpu.cpp",
    CSRC / "linear_bf16_cpu.cpp",
    CSRC / "linear_amx_cpu.cpp",
    CSRC / "linear_f32_cpu.cpp",
    CSRC / "layer_ops_cpu.cpp",
    CSRC / "token_mask_cpu.cpp",
    CSRC / "lora_cpu.cpp",
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
DONE = "built.json"  # written last by a build that succeeded: its library is complete
# CPU-seconds a full build took on a 2-vCPU EPYC (Zen 3); the estimate before this machine has one
BUILD_CPU_S = 100.0
KEEP_BUILDS = 4  # builds of other sources kept per cache (older checkouts), most recently used first


def build_key() -> str:
    """What changes the binary: the CPU's instruction sets, torch and Python, the compiler flags,
    the sources. Nothing else: two virtualenvs or checkouts of the same code share one build."""
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    except OSError:
        flags = platform.processor()
    import torch

    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = f"{flags}|{torch.__version__}|{sys.version_info[:2]}|{CFLAGS}|{code.hex()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def find_build() -> Path | None:
    """The directory of a finished build of these sources on this machine, if any (its use noted,
    so the builds kept are the ones in use)."""
    key = build_key()
    for root in kernel_cache_dirs():
        candidate = root / key
        if (candidate / DONE).exists() and (candidate / f"{NAME}.so").exists():
            with contextlib.suppress(OSError):
                os.utime(candidate / DONE)
            return candidate
    return None


def kernels_built() -> bool:
    """Whether this machine already holds a build of these sources (loading takes a second)."""
    return find_build() is not None


def build_directory() -> Path:
    """Where this process builds these sources (made if missing): under its own cache home."""
    build_dir = kernel_cache_dirs()[0] / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


def build_estimate() -> str:
    """How long a build takes here: the last build's wall time on this machine where one was
    recorded, else the CPU time measured on a 2-vCPU host over the cores available (at most one
    per source file, as ninja compiles them)."""
    records = []
    for root in kernel_cache_dirs():
        for done in root.glob(f"*/{DONE}"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                records.append(float(json.loads(done.read_text())["seconds"]))
    if records:
        return f"about {max(records) / 60:.1f} min here last time"
    cores = min(len(SOURCES), os.cpu_count() or 1)
    return f"about {BUILD_CPU_S / cores / 60:.0f}-{2 * BUILD_CPU_S / cores / 60:.0f} min on {cores} cores"


def build(build_dir: Path) -> Path:
    """Compile (torch's ``cpp_extension.load`` on copies of the sources inside ``build_dir``),
    then mark the build finished and prune old builds."""
    from torch.utils.cpp_extension import load

    started = time.monotonic()
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        copy, code = src / path.name, path.read_bytes()
        if copy.exists() and copy.read_bytes() == code:
            continue  # the key holds the sources' hash: an unchanged copy keeps its time for ninja
        partial = copy.with_name(f"{copy.name}.{os.getpid()}.tmp")
        partial.write_bytes(code)
        partial.replace(copy)
    library = load(
        name=NAME,
        sources=[str(src / path.name) for path in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
        is_python_module=False,  # operators only (torch.ops.tokenfleet): no pybind11 to compile
    )
    seconds = time.monotonic() - started
    (build_dir / DONE).write_text(json.dumps({"seconds": round(seconds, 1), "cores": os.cpu_count()}))
    log.info("built the CPU kernels in %.0f s", seconds)
    prune_builds(build_dir.parent, keep=build_dir)
    return Path(library)


def prune_builds(root: Path, keep: Path) -> None:
    """Remove all but the :data:`KEEP_BUILDS` most recently used builds under ``root`` (other
    checkouts' sources), never ``keep`` nor one being built (no mark yet)."""
    finished = sorted(
        (d for d in root.iterdir() if (d / DONE).exists() and d != keep),
        key=lambda d: (d / DONE).stat().st_mtime,
        reverse=True,
    )
    for old in finished[KEEP_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


PROGRESS_EVERY_S = 15.0


@contextlib.contextmanager
def progress_lines(what: str) -> Iterator[None]:
    """A log line every :data:`PROGRESS_EVERY_S` seconds while the block runs (``what``, and the
    seconds so far), so a minute's build never looks like a hang."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            log.info("%s (%.0f s)", what, time.monotonic() - start)

    threading.Thread(target=tick, name="tokenfleet-progress", daemon=True).start()
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
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(
                "another process is building the CPU kernels here (%s); waiting for it", build_estimate()
            )
            with progress_lines("still waiting for the CPU kernels' build"):
                fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
