"""NVSHMEM transport: one-sided GPU-to-GPU pulls between executors of one NVSHMEM world (paper §5.2).

Each executor is one PE on one GPU. At start-up every PE collectively allocates one symmetric
arena (``nvshmem.core.bytetensor((capacity,))``) and sub-allocates it locally with the buddy
allocator — NVSHMEM allocation is collective, so per-tensor ``nvshmem_malloc`` is not an option.
Because the heap is symmetric, a tensor at ``offset`` in the producer's arena is pulled with
``getmem_on_stream(dst = our_base + our_offset, src = our_base + offset, nbytes, pe, stream)``:
peers exchange offsets, never pointers.

Bootstrap is UID-based (no MPI): rank 0 creates the 128-byte unique id and the caller-provided
``exchange_uid`` callback shares it (through Redis, a file, ...); every PE then blocks in
``init`` until all ``nranks`` have joined. The world is fixed at init (re-init in one process is
unreliable), so scaling down means routing no more work to a PE, not leaving the world.

Integrity tags (``tags.py``) live in a second symmetric allocation of ``(slots + 1) * 16`` bytes
(at most 1 MiB): slot ``s`` of PE ``p`` is read with one 16-byte ``getmem`` after the tensor's,
into the extra last entry of our own table (a staging area no tensor uses).

``nvshmem`` (nvshmem4py), ``cuda.core`` and torch are imported lazily inside the class so this
module imports on machines without them; constructing the transport there raises a
DataPlaneError that says what is missing. Not exercised by CPU CI (marker ``nvshmem``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from libs.dataplane.device_arena import TensorArena
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.dataplane.transport.base import Transport, read_staged
from libs.dataplane.transport.tags import TAG, TagTable, check_tag, expected_tag, slots_for, stale
from libs.protocol.tensor_meta import TensorMeta

#: Headroom added to NVSHMEM_SYMMETRIC_SIZE beyond the arena (NVSHMEM's own symmetric objects).
_HEAP_HEADROOM = 256 << 20

#: ``exchange_uid(uid)``: rank 0 passes its unique id (bytes) and the callback publishes it;
#: other ranks pass None and the callback returns the published bytes (blocking until present).
UidExchange = Callable[[bytes | None], bytes]


class NvshmemArena(TensorArena):
    """The local PE's symmetric arena: buddy-allocated device memory (a :class:`TensorArena` over
    the symmetric tensor; ``base_ptr`` is its address, the same offset on every PE)."""

    kind = "nvshmem"

    def __init__(self, name: str, symmetric: Any, min_block: int = 256, *, fence: Any = None) -> None:
        super().__init__(name, symmetric, min_block, fence=fence)
        self.base_ptr: int = int(symmetric.data_ptr())

    @property
    def symmetric(self) -> Any:
        return self.memory

    def _release_backing(self) -> None:
        # Freeing symmetric memory is collective; a lone executor leaving must not call it (it
        # would hang waiting for the other PEs). NvshmemTransport.finalize() frees it for all.
        pass


class DeviceTagTable(TagTable):
    """A tag table in the first ``slots`` entries of a symmetric uint8 CUDA tensor. Writes are
    synchronous host-to-device copies on the current stream, so a stamp lands after the tensor's
    bytes (copied on the same stream) and a clear before the block is reused."""

    def __init__(self, symmetric: Any, slots: int, *, name: str, torch: Any) -> None:
        super().__init__(None, slots, name=name)
        self._symmetric: Any = symmetric
        self._torch = torch

    def _write(self, slot: int, data: bytes) -> None:
        if self._symmetric is not None:
            src = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
            self._symmetric[slot * TAG.size : (slot + 1) * TAG.size].copy_(src)

    def _read(self, slot: int) -> bytes:
        if self._symmetric is None:
            return bytes(TAG.size)
        return bytes(self._symmetric[slot * TAG.size : (slot + 1) * TAG.size].cpu().numpy())

    def close(self) -> None:
        self._symmetric = None


class NvshmemTransport(Transport):
    """This PE's symmetric arena plus one-sided ``getmem`` pulls from other PEs.

    ``address`` (TensorMeta.address) is this PE's rank. All PEs must use the same ``capacity``
    (symmetric allocation). ``device_index`` defaults to ``rank % torch.cuda.device_count()``.
    ``close()`` is local (stops allocating); ``finalize()`` is collective and must be called by
    every PE together at world shutdown.
    """

    kind = "nvshmem"

    def __init__(
        self,
        *,
        rank: int,
        nranks: int,
        capacity: int,
        exchange_uid: UidExchange,
        device_index: int | None = None,
        min_block: int = 256,
    ) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} is not in [0, {nranks})")
        try:
            import numpy as np
            import nvshmem.bindings as bindings
            import nvshmem.core as nvshmem
            import torch
        except ImportError as exc:
            raise DataPlaneError(
                f"NVSHMEM transport unavailable: {exc} (install the 'gpu' extra: nvshmem4py-cu13, cuda-core)"
            ) from exc
        try:
            from cuda.core import Device
        except ImportError:  # cuda.core < 0.5 kept it under .experimental
            from cuda.core.experimental import Device
        if not torch.cuda.is_available():
            raise DataPlaneError("NVSHMEM transport unavailable: no CUDA device is visible to torch")
        self._torch = torch
        self._nvshmem = nvshmem
        self._bindings = bindings
        self.rank = rank
        self.nranks = nranks
        index = rank % torch.cuda.device_count() if device_index is None else device_index
        torch.cuda.set_device(index)
        device = Device(index)
        device.set_current()

        # The symmetric heap's size is fixed at init: make room for the arena unless the
        # operator sized it explicitly.
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(capacity + _HEAP_HEADROOM))

        uid = nvshmem.get_unique_id(empty=rank != 0)
        raw = uid._data.view(np.uint8)  # the 128-byte id; ``_data`` is how NVIDIA's examples share it  # noqa: SLF001 - nvshmem4py's unique id bytes, as NVIDIA's examples share them
        if rank == 0:
            exchange_uid(bytes(raw))
        else:
            data = exchange_uid(None)
            if len(data) != raw.nbytes:
                raise DataPlaneError(f"NVSHMEM unique id must be {raw.nbytes} bytes, got {len(data)}")
            raw[:] = np.frombuffer(data, dtype=np.uint8)
        try:
            # Blocks until all nranks PEs have called init with the same uid.
            nvshmem.init(device=device, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")
            symmetric = nvshmem.bytetensor((capacity,))  # collective: every PE, same size
            slots = slots_for(capacity, min_block)
            tags = nvshmem.bytetensor(((slots + 1) * TAG.size,))  # collective; last entry: staging
            tags.zero_()  # every slot empty (generation 0) before any peer can read one
            torch.cuda.synchronize()
        except Exception as exc:  # NvshmemError / NvshmemInvalid: say why, as our error type
            raise DataPlaneError(f"NVSHMEM init of PE {rank}/{nranks} failed: {exc}") from exc
        if int(nvshmem.my_pe()) != rank:
            raise DataPlaneError(f"NVSHMEM assigned PE {nvshmem.my_pe()} but this executor is rank {rank}")
        self.arena: NvshmemArena = NvshmemArena(
            f"nvshmem-pe{rank}", symmetric, min_block, fence=lambda: torch.cuda.current_stream().synchronize()
        )
        self._tag_memory = tags
        self._symmetric = symmetric
        self.tags: DeviceTagTable = DeviceTagTable(tags, slots, name=self.arena.name, torch=torch)
        self._staging_lock = threading.Lock()
        self.address = str(rank)
        self._finalized = False

    def _pe(self, meta: TensorMeta) -> int:
        try:
            pe = int(meta.address)
        except ValueError:
            raise TransportError(meta.address, "nvshmem address must be a PE rank") from None
        if not 0 <= pe < self.nranks:
            raise TransportError(meta.address, f"PE {pe} is not in this world of {self.nranks}")
        return pe

    def read_into(self, meta: TensorMeta, offset: int) -> None:
        """One-sided get of ``meta.nbytes`` from PE ``meta.address`` into our arena at ``offset``.

        Issued on the current CUDA stream; returns once the bytes have landed (an event on that
        stream is synchronised), so the caller may hand the block to any stream. Then the
        tensor's tag is fetched from the peer and checked (StaleTensorError on a mismatch).
        """
        if offset < 0 or offset + meta.nbytes > self.arena.capacity:
            raise ValueError(f"destination [{offset}, {offset + meta.nbytes}) outside our arena")
        self._get(meta, self.arena.base_ptr + offset)

    def read_to(self, meta: TensorMeta, dst: Any) -> None:
        """:meth:`read_into` into any flat uint8 CUDA tensor of ``meta.nbytes`` (another transport's
        arena block, FallbackTransport: the destination of a get need not be symmetric)."""
        if dst.numel() != meta.nbytes:
            raise ValueError(f"destination holds {dst.numel()} bytes, tensor has {meta.nbytes}")
        self._get(meta, int(dst.data_ptr()))

    def _get(self, meta: TensorMeta, dst_ptr: int) -> None:
        self._check_kind(meta)
        pe = self._pe(meta)
        if meta.offset + meta.nbytes > self.arena.capacity:
            # Symmetric arenas have one size, so our capacity bounds the peer's too.
            raise TransportError(
                meta.address, f"range [{meta.offset}, {meta.offset + meta.nbytes}) outside arena"
            )
        if meta.nbytes == 0:
            return
        torch = self._torch
        stream = torch.cuda.current_stream()
        base = self.arena.base_ptr
        try:
            # src is *our* address of the symmetric object; NVSHMEM translates it for PE `pe`.
            self._bindings.getmem_on_stream(
                dst_ptr, base + meta.offset, meta.nbytes, pe, int(stream.cuda_stream)
            )
        except Exception as exc:
            raise TransportError(meta.address, f"nvshmem getmem failed: {exc}") from exc
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()
        if meta.generation:
            self._check_tag(meta, pe)

    def _check_tag(self, meta: TensorMeta, pe: int) -> None:
        """Fetch slot ``meta.tag_slot`` of PE ``pe``'s tag table (after the data: NVSHMEM orders
        gets on one stream) and check it."""
        if not 0 <= meta.tag_slot < self.tags.slots:  # symmetric: the peer's table is ours in size
            raise stale(meta, f"tag slot {meta.tag_slot} is outside the table of {self.tags.slots}")
        torch = self._torch
        base = int(self._tag_memory.data_ptr())
        staging = self.tags.slots * TAG.size
        with self._staging_lock:
            stream = torch.cuda.current_stream()
            try:
                self._bindings.getmem_on_stream(
                    base + staging, base + meta.tag_slot * TAG.size, TAG.size, pe, int(stream.cuda_stream)
                )
            except Exception as exc:
                raise TransportError(meta.address, f"nvshmem getmem of the tag failed: {exc}") from exc
            stream.synchronize()
            tag = bytes(self._tag_memory[staging : staging + TAG.size].cpu().numpy())
        check_tag(meta, expected_tag(meta), TAG.unpack(tag))

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """Pull into host memory: get into a staging block of our arena, then copy device-to-host."""
        read_staged(self, meta, self._check(meta, dst))

    def _check_kind(self, meta: TensorMeta) -> None:
        if meta.transport != self.kind:
            raise TransportError(meta.address, f"{meta.transport!r} tensor cannot be read over nvshmem")

    def finalize(self) -> None:
        """Collective teardown: free the symmetric arena and finalize NVSHMEM (all PEs together)."""
        if self._finalized:
            return
        self._finalized = True
        symmetric = self._symmetric
        self.tags.close()
        self.arena.close()
        self._nvshmem.free_tensor(self._tag_memory)
        self._nvshmem.free_tensor(symmetric)
        self._nvshmem.finalize()
