"""An adapter's ``adapter_model.safetensors`` read without holding the GIL for long: the file is
read in one call (which lets other threads run) and its tensors are views of those bytes, made
from the JSON header this module checks. safetensors' own reader holds the GIL while it copies:
from the adapter loader's niced thread that held up the step loop's Python for many steps' time
(a priority inversion: the holder waits behind our compute threads for a CPU; PERFORMANCE.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_HEADER = 100 << 20  # as safetensors' own limit


class SafetensorsError(ValueError):
    """Not a safetensors file, or one whose header does not match its bytes."""


def read_header(path: Path, size: int, head: bytes | bytearray) -> tuple[dict[str, Any], int]:
    """The header of the file at ``path`` (``size`` bytes, starting with ``head``) and where
    its data starts."""
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, shorter than a safetensors header")
    length = int.from_bytes(head[:8], "little")
    if length > min(MAX_HEADER, size - 8):
        raise SafetensorsError(f"{path}: a header of {length} bytes in a file of {size}")
    try:
        header = json.loads(head[8 : 8 + length])
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for name, info in header.items():
        shape, offsets = _field(info, "shape"), _field(info, "data_offsets")
        dtype = DTYPES.get(str(info.get("dtype"))) if isinstance(info, dict) else None
        ok = dtype is not None and all(isinstance(n, int) and n >= 0 for n in [*shape, *offsets])
        if not ok or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1] <= data:
            raise SafetensorsError(f"{path}: tensor {name!r} has a bad entry {info!r}")
        assert dtype is not None
        numel = 1
        for n in shape:
            numel *= n
        if numel * dtype.itemsize != offsets[1] - offsets[0]:
            raise SafetensorsError(f"{path}: tensor {name!r}'s shape {shape} does not fit its bytes")
    return header, 8 + length


def shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the header alone."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += f.read(min(length, MAX_HEADER))
    header, _ = read_header(path, size, head)
    return {name: tuple(info["shape"]) for name, info in header.items()}


def read_tensors(path: Path, max_bytes: int) -> dict[str, torch.Tensor]:
    """Every tensor of the file, as views of one buffer it is read into; a file over
    ``max_bytes`` is refused before any is read."""
    size = path.stat().st_size
    if size > max_bytes:
        raise SafetensorsError(f"{path}: {size} bytes, more than such a file can hold here ({max_bytes})")
    buffer = bytearray(size)
    view, read = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        while read < size:  # the GIL is let go while the bytes come in; a read stops at 2 GiB
            got = f.readinto(view[read:])
            if not got:
                break
            read += got
    view.release()
    if read != size:
        raise SafetensorsError(f"{path}: read {read} of {size} bytes (the file changed meanwhile)")
    header, start = read_header(path, size, buffer)
    tensors = {}
    for name, info in header.items():
        dtype, (begin, end) = DTYPES[info["dtype"]], info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        if not count:  # frombuffer takes no empty range
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + begin)
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def _field(info: Any, key: str) -> list[Any]:
    value = info.get(key) if isinstance(info, dict) else None
    return value if isinstance(value, list) else [None]
