"""The shapes the native engine pads steps to, so that compiled code and oneDNN's GEMMs meet few
distinct sizes."""

from __future__ import annotations

MIN_DECODE_BUCKET = 8  # compiled decode pads batches to 8, 16, 32, ...: a padded row costs almost nothing
PREFILL_SIZES_PER_DOUBLING = 16  # oneDNN builds a GEMM per new row count: keep the counts few
MIN_PREFILL_PAD_STEP = 16


def prefill_padded_size(tokens: int) -> int:
    """``tokens`` rounded up to one of :data:`PREFILL_SIZES_PER_DOUBLING` sizes between each two
    powers of two (steps of at least :data:`MIN_PREFILL_PAD_STEP`; at most 1/16 more tokens)."""
    octave = tokens.bit_length() - 1  # 2**octave <= tokens < 2**(octave + 1)
    step = 1 << max(0, octave - (PREFILL_SIZES_PER_DOUBLING.bit_length() - 1))
    step = max(MIN_PREFILL_PAD_STEP, step)
    return -(-tokens // step) * step


def decode_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes compiled decode pads to: 8, 16, 32, ... up to ``max_batch_size``."""
    buckets = [MIN_DECODE_BUCKET]
    while buckets[-1] < max_batch_size:
        buckets.append(buckets[-1] * 2)
    return buckets


def prefill_forwards(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows (by index, in order) grouped into forwards of at most ``budget`` tokens each; a row
    longer than the budget gets a forward of its own."""
    forwards: list[list[int]] = []
    in_last = 0  # tokens in the last forward
    for row, length in enumerate(lengths):
        if forwards and in_last + length <= budget:
            forwards[-1].append(row)
            in_last += length
        else:
            forwards.append([row])
            in_last = length
    return forwards
