"""Where the bytes go: the chunks a checkpoint is read in (:class:`_Chunk`, ranges of the flat host
buffer), each tensor's place in a flat *device* buffer (:func:`device_layout`), the tensors as views
of a flat buffer (:func:`views`), and each chunk's pieces of tensors in the device buffer
(:func:`_segments`).

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
