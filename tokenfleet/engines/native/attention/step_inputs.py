"""A step's inputs and attention metadata: index arithmetic on the host, then one copy to the device.

On an accelerator every host-to-device copy of a small pageable tensor blocks the host until the
device has drained its queue; a step used to make seven of them (and one more per layer in
prefill). Here all of a step's integer inputs are laid in one pinned buffer and sent with one
non-blocking copy into a persistent device buffer; masks are built on the device from the
lengths. On the CPU the host tensors are used as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfleet.engines.native.attention.paged import PrefillGroups, StepMetadata
from tokenfleet.engines.native.attention.torch_route import length_groups
from tokenfleet.kvcache.store import PagedKVStore


class Uploader:
    """Sends int64 tensors to ``device`` in one copy; returns device views shaped like them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copies = 0  # host-to-device copies made (one per send): for tests and profiles
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._sent: torch.cuda.Event | None = None

    def send(self, tensors: Sequence[torch.Tensor], into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``into``: a device buffer to land in (a captured graph's fixed inputs), else our own."""
        if self.device.type == "cpu" and into is None:
            return [t.to(torch.long) for t in tensors]
        sizes = [t.numel() for t in tensors]
        total = sum(sizes)
        if self._host is None or self._host.numel() < total:
            size = max(total, 2 * (0 if self._host is None else self._host.numel()), 4096)
            pin = self.device.type != "cpu"
            self._host = torch.empty(size, dtype=torch.long, pin_memory=pin)
            self._dev = torch.empty(size, dtype=torch.long, device=self.device)
        elif self._sent is not None:
            self._sent.synchronize()  # the last copy has left the host buffer (long done by now)
        host = self._host[:total]
        torch.cat([t.reshape(-1).to(torch.long) for t in tensors], out=host)
        assert self._dev is not None
        dev = (into if into is not None else self._dev)[:total]
        dev.copy_(host, non_blocking=True)
        self.copies += 1
        if self.device.type == "cuda":
            self._sent = torch.cuda.Event()
            self._sent.record()
        return [part.view(t.shape) for part, t in zip(dev.split(sizes), tensors)]


def padded_tables(tables: Sequence[list[int]], scratch_block: int, min_width: int = 1) -> torch.Tensor:
    """Block tables ``[B, width]``, each row padded with the scratch block to the widest (at least
    ``min_width``)."""
    width = max(min_width, max(len(t) for t in tables))
    return torch.tensor([t + [scratch_block] * (width - len(t)) for t in tables], dtype=torch.long)


def write_places(
    blocks: torch.Tensor, offsets: torch.Tensor, block_size: int, use_kernel: bool
) -> list[torch.Tensor]:
    """Where each token's K/V go: block and offset for the C++ kernels, one pool slot otherwise."""
    return [blocks, offsets] if use_kernel else [blocks * block_size + offsets]


Places = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def placed(places: list[torch.Tensor]) -> Places:
    """:func:`write_places`' tensors (on the device) as ``slots, write_blocks, write_offsets``."""
    return (None, places[0], places[1]) if len(places) == 2 else (places[0], None, None)


def decode_step(
    store: PagedKVStore,
    upload: Uploader,
    tables: torch.Tensor,
    stored: torch.Tensor,
    tokens: torch.Tensor,
    use_kernel: bool,
    use_triton: bool = False,
    into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
    """``input_ids`` ``[B, 1]``, ``position_ids`` ``[B, 1]`` and metadata for a decode step whose
    rows have ``stored`` tokens (the newest, ``tokens``, among them) in blocks ``tables``."""
    bs = store.block_size
    last = stored - 1
    places = write_places(tables[torch.arange(len(tables)), last // bs], last % bs, bs, use_kernel)
    sent = upload.send([tokens[:, None], last[:, None], tables, stored, *places], into)
    ids, positions, dev_tables, lengths, *places = sent
    slots, write_blocks, write_offsets = placed(places)
    mask = None
    if not use_kernel and not use_triton:
        key_pos = torch.arange(tables.shape[1] * bs, device=upload.device)
        mask = (key_pos[None, :] < lengths[:, None])[:, None, None, :]
    meta = StepMetadata(
        store=store,
        is_prefill=False,
        slots=slots,
        write_blocks=write_blocks,
        write_offsets=write_offsets,
        mask=mask,
        block_tables=dev_tables,
        lengths=lengths,
        use_kernel=use_kernel,
        use_triton=use_triton,
    )
    return ids, positions, meta


def prefill_step(
    store: PagedKVStore,
    upload: Uploader,
    table: torch.Tensor,
    lengths: torch.Tensor,
    packed: torch.Tensor,
    use_kernel: bool,
    cached: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepMetadata]:
    """``input_ids`` ``[1, N]``, ``position_ids`` ``[1, N]``, each prompt's last token's index and
    metadata for a packed prefill of prompts of ``lengths`` laid end to end (``packed``), prompt
    ``b``'s blocks in ``table[b]``. ``cached``: tokens each prompt has in the pool before its
    packed ones (its positions start there, and its queries attend to them too)."""
    bs = store.block_size
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    offsets = torch.tensor(cached, dtype=torch.long) if cached is not None else None
    positions = torch.arange(len(segment)) - starts[segment]
    if offsets is not None:
        positions = positions + offsets[segment]
    places = write_places(table[segment, positions // bs], positions % bs, bs, use_kernel)
    groups = None if use_kernel or cached is not None else group_indices(lengths)
    # the C++ operator reads prompt bounds (and a cached prefix's blocks); SDPA runs over groups of
    # similar lengths, their index arithmetic done once here, not per layer, or prompt by prompt
    # over its blocks where a prefix is cached
    if use_kernel:
        bounds = [torch.cat([starts, ends[-1:]]), *([table, offsets] if offsets is not None else [])]
    elif groups is not None:
        bounds = [lengths, groups.index]
    else:
        bounds = [table]
    sent = upload.send([packed[None], positions[None], ends - 1, *bounds, *places])
    ids, pos, last = sent[:3]
    bounds = sent[3 : 3 + len(bounds)]
    slots, write_blocks, write_offsets = placed(sent[3 + len(bounds) :])
    mask = None
    if groups is not None:
        dev_lengths, groups.index = bounds
        index = torch.arange(int(lengths.max()), device=upload.device)
        causal = index[None, :] <= index[:, None]  # [L, L]
        mask = (causal[None] & (index[None, :] < dev_lengths[:, None])[:, None, :])[:, None]
    meta = StepMetadata(
        store=store,
        is_prefill=True,
        slots=slots,
        write_blocks=write_blocks,
        write_offsets=write_offsets,
        mask=mask,
        starts=bounds[0] if use_kernel else None,
        groups=groups,
        use_kernel=use_kernel,
        block_tables=bounds[-2 if use_kernel else 0] if cached is not None else None,
        cached=bounds[-1] if use_kernel and cached is not None else None,
        context=(list(cached), lengths.tolist()) if cached is not None else None,
    )
    return ids, pos, last, meta


def group_indices(lengths: torch.Tensor) -> PrefillGroups:
    """For each group of similar lengths (see :func:`length_groups`): its rows, each of its tokens'
    place in the packed step and in the group's ``[rows, width]`` padding."""
    starts = torch.cumsum(lengths, 0) - lengths
    parts: list[torch.Tensor] = []
    shape: list[int] = []
    for rows in length_groups(lengths.tolist()):
        index = torch.tensor(rows)
        lens = lengths[index]
        width = int(lens.max())
        segment = torch.repeat_interleave(torch.arange(len(rows)), lens)
        position = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[segment]
        parts += [index, starts[index][segment] + position, segment * width + position]
        shape += [len(rows), len(segment), width]
    return PrefillGroups(index=torch.cat(parts), shape=shape)
