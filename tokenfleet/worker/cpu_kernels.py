"""The CPU paged decode-attention kernel (``csrc/paged_decode_cpu.cpp``), built on first use.

Loading it registers the operator ``torch.ops.tokenfleet.paged_decode`` (write the step's K/V,
attend), with a shape-only implementation here so that ``torch.compile`` can trace it. It is
compiled for this machine's CPU with the C++ compiler PyTorch finds (``torch.utils.cpp_extension``),
cached under ``~/.cache/tokenfleet/kernels/<cpu>``, and loaded once per process. When it cannot
be built (no compiler, no ``ninja``) or ``TOKENFLEET_PAGED_KERNEL=0``, callers get ``None`` and
fall back to gathering the blocks and calling SDPA: slower, same results.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
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

    key = f"{flags}|{torch.__version__}|{SOURCE.read_bytes().hex()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def paged_decode_kernel() -> Any:
    """The compiled extension module, or ``None`` when it is disabled or cannot be built."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("TOKENFLEET_PAGED_KERNEL", "1") == "0":
            return None
        try:
            from torch.utils.cpp_extension import load

            build_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            build_dir = build_dir / "tokenfleet" / "kernels" / _cpu_tag()
            build_dir.mkdir(parents=True, exist_ok=True)
            log.info("loading the CPU paged-attention kernel (built once per machine, ~30 s)")
            _module = load(
                name="tokenfleet_paged_decode_cpu",
                sources=[str(SOURCE)],
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-fopenmp",
                    "-fassociative-math",
                    "-fno-signed-zeros",
                    "-fno-trapping-math",
                    "-fno-math-errno",  # lets the softmax's exp vectorize
                ],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
            _register_fake()
        except Exception as e:  # no compiler, no ninja, an odd platform: the gather path still works
            log.warning("CPU paged-attention kernel unavailable (%s); using gather + SDPA", str(e)[:300])
            _module = None
        return _module


def _register_fake() -> None:
    import torch

    @torch.library.register_fake("tokenfleet::paged_decode")
    def _(query, key, value, k_cache, v_cache, write_blocks, write_offsets, block_tables, lengths, scale):
        return query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])
