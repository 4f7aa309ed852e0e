"""Where the bytes go: the chunks a checkpoint is read in (:class:`_Chunk`, ranges of the flat host
buffer), the chunks a load of a suffix of the layers needs (:func:`needed_ranges`,
:func:`needed_chunks`), each tensor's place in a flat *device* buffer (:func:`device_layout`), the
tensors as views of a flat buffer (:func:`views`), and each chunk's pieces of tensors in the device
buffer (:func:`_segments`).

torch is imported inside functions: ``libs.dataplane`` stays importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from libs.dataplane.checkpoint import Index

if TYPE_CHECKING:
    import torch


DEVICE_ALIGN = 512  # tensor offsets in a device buffer: as the CUDA caching allocator aligns them


def device_layout(index: Index) -> tuple[dict[str, int], int]:
    """Where each stored tensor goes in a flat *device* buffer (offsets aligned to DEVICE_ALIGN, so
    kernels see the alignment ``.to("cuda")`` would give), and the buffer's size. The host layout
    keeps the source's address residues instead (:mod:`libs.dataplane.checkpoint.format`, "Alignment")."""
    offsets: dict[str, int] = {}
    at = 0
    for e in index.tensors:
        if e.alias_of is None:
            at = -(-at // DEVICE_ALIGN) * DEVICE_ALIGN
            offsets[e.name] = at
            at += e.nbytes
    return offsets, at


def views(index: Index, flat: torch.Tensor, offsets: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``index`` as a view of ``flat``: the partitions back to back (the host
    layout), or at ``offsets`` (:func:`device_layout`); an alias is the very tensor object of the
    name it aliases."""
    import torch

    bases = index.partition_bases()
    out: dict[str, torch.Tensor] = {}
    for e in index.tensors:
        if e.alias_of is not None:
            out[e.name] = out[e.alias_of]
            continue
        at = offsets[e.name] if offsets is not None else bases[e.partition] + e.offset
        out[e.name] = flat[at : at + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
    return out


def needed_ranges(index: Index, first_layer: int) -> list[tuple[int, int]]:
    """The flat byte ranges ``[lo, hi)`` a load of the layers ``index.layers[first_layer:]`` needs,
    sorted: from the first of those layers' start to the end of the buffer and, before it, the
    stored bytes of any of their tensors tied to (an ``alias_of``) a tensor of an earlier layer
    (a tied head's weight lives with the embedding), so every tensor of those layers has its bytes.
    Empty when ``first_layer`` is past the last layer; the whole buffer for ``first_layer == 0``."""
    if first_layer <= 0:
        return [(0, index.total_bytes)] if index.total_bytes else []
    suffix = index.layers[first_layer:]
    if not suffix:
        return []
    start = min(layer.start for layer in suffix)  # layers[first_layer].start: starts are in order
    names = {layer.name for layer in suffix}
    bases = index.partition_bases()
    out = [
        (lo, min(lo + e.nbytes, start))
        for e in index.tensors
        if e.alias_of is not None and e.layer in names and e.nbytes
        and (lo := bases[e.partition] + e.offset) < start
    ]  # fmt: skip
    if start < index.total_bytes:
        out.append((start, index.total_bytes))
    return sorted(out)


def needed_chunks(chunks: list[_Chunk], ranges: list[tuple[int, int]]) -> list[bool]:
    """Per chunk (in flat order), whether it overlaps one of ``ranges`` (sorted, as
    :func:`needed_ranges` gives them): the chunks a load reads."""
    out: list[bool] = []
    r = 0
    for c in chunks:
        lo, hi = c.flat, c.flat + c.nbytes
        while r < len(ranges) and ranges[r][1] <= lo:
            r += 1
        out.append(r < len(ranges) and ranges[r][0] < hi)
    return out


def _segments(
    index: Index, chunks: list[_Chunk], offsets: dict[str, int]
) -> list[list[tuple[int, int, int]]]:
    """Per chunk, the pieces of tensors it holds: (start, end) within the chunk and where the
    piece goes in the device buffer."""
    bases = index.partition_bases()
    spans = sorted(
        (bases[e.partition] + e.offset, e.nbytes, offsets[e.name])
        for e in index.tensors
        if e.alias_of is None and e.nbytes
    )
    out: list[list[tuple[int, int, int]]] = []
    first = 0
    for c in chunks:
        lo, hi = c.flat, c.flat + c.nbytes
        pieces = []
        while first < len(spans) and spans[first][0] + spans[first][1] <= lo:
            first += 1
        j = first
        while j < len(spans) and spans[j][0] < hi:
            start, n, dev = spans[j]
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                pieces.append((a - lo, b - lo, dev + a - start))
            j += 1
        out.append(pieces)
    return out


class _Chunk:
    __slots__ = ("partition", "number", "file_offset", "nbytes", "flat")

    def __init__(self, partition: int, number: int, file_offset: int, nbytes: int, flat: int) -> None:
        self.partition = partition
        self.number = number
        self.file_offset = file_offset
        self.nbytes = nbytes
        self.flat = flat
