"""The CPU kernels (``csrc/``), loaded once per process (built first where this machine has no
build of these sources: :mod:`.build`).

Loading them registers the operators ``torch.ops.tokenfleet.paged_decode`` and
``torch.ops.tokenfleet.paged_prefill`` (write the step's K/V into the pool, attend), and
``pack_linear_bf16`` / ``linear_bf16`` (bf16 linears on AVX512-BF16, see ``linear.bf16``),
``pack_linear_amx`` / ``linear_amx`` (bf16 linears on AMX tiles, see ``linear.amx``) and a
decoder layer's elementwise parts (``rms_norm``, ``add_rms_norm``, ``rotary_``, ``silu_and_mul``,
see ``decoder``), with shape-only implementations here so that ``torch.compile`` can trace them.
When they cannot be built (no compiler, no ``ninja``) or ``--no-paged-kernel`` turns them off,
callers get ``None`` and fall back to gathering the blocks and calling SDPA, and to torch's
linears and layer ops: slower, same results.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from tokenfleet.engines.native.kernels.build import (
    DONE,
    NAME,
    build,
    build_directory,
    build_estimate,
    build_lock,
    find_build,
    progress_lines,
)

log = logging.getLogger(__name__)

_lock = threading.Lock()
_library: Path | None = None
_tried = False


def load_kernels(enabled: bool = True) -> Path | None:
    """The loaded kernel library's path, or ``None`` when not ``enabled`` or it cannot be built."""
    global _library, _tried
    if not enabled:
        return None
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        _tried = True
        try:
            _library = load_or_build()
            _register_fake()
        except Exception as e:  # no compiler, no ninja, an odd platform: the gather path still works
            log.warning("CPU paged-attention kernels unavailable (%s); using gather + SDPA", str(e)[:300])
            _library = None
        return _library


def kernels_loaded() -> bool:
    """Whether this process has loaded the kernels already (never builds or loads them)."""
    return _library is not None


def load_or_build() -> Path:
    """This machine's build of these sources, loaded; built first (once) where there is none.
    A process that finds another building waits for it, with progress lines, and loads its build."""
    built = find_build()
    if built is not None:
        log.info("loading the CPU kernels (built on this machine before: %s)", built)
        return _load(built)
    build_dir = build_directory()
    with build_lock(build_dir):
        if (build_dir / DONE).exists():  # another process built them while we waited
            return _load(build_dir)
        log.info("building the CPU kernels: once per machine, %s", build_estimate())
        with progress_lines("still building the CPU kernels"):
            return build(build_dir)


def _load(build_dir: Path) -> Path:
    """Load a finished build's library into this process, which registers its operators."""
    import torch

    library = build_dir / f"{NAME}.so"
    torch.ops.load_library(str(library))
    return library


def _register_fake() -> None:
    import torch

    @torch.library.register_fake("tokenfleet::paged_decode")
    def _(query, key, value, k_cache, v_cache, write_blocks, write_offsets, block_tables, lengths, scale):
        return query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])

    def linear(x, packed, out_features, bias):
        return x.new_empty(*x.shape[:-1], out_features)

    for op in ("tokenfleet::linear_bf16", "tokenfleet::linear_amx", "tokenfleet::linear_f32"):
        torch.library.register_fake(op)(linear)

    @torch.library.register_fake("tokenfleet::paged_prefill")
    def _(
        query,
        key,
        value,
        k_cache,
        v_cache,
        write_blocks,
        write_offsets,
        starts,
        scale,
        tables=None,
        cached=None,
    ):
        return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
