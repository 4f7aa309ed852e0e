"""Simulated executors: replay profiled load and compute times instead of computing.

A simulated executor is the real :class:`~services.executor.service.ExecutorService` (registration,
heartbeats, dispatch acks, completions, releases) with two parts swapped:

* :class:`SimRunner` sleeps for the node model's profiled time — the load time too when the model is
  not resident — keeping an LRU cache of resident models bounded by the profile's GPU memory, and
  reports the measured sleep (divided by the time scale) as the node's GPU time;
* :class:`SimStore` keeps the data plane's *metadata*: outputs get real buddy-allocated offsets in a
  virtual arena and refcounts, released as consumers read them, so placement by input locality and
  arena pressure behave as on a real executor; no bytes exist.

Many run in one process (``T2I_EXECUTOR_SIM_COUNT``), so the real gateway, registry and scheduler
can be driven at 4–256 "GPUs" on a small machine. ``time_scale`` < 1 replays faster than real time;
reported times stay in the profile's units, so vTime and slack are in profiled GPU seconds.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
import zlib
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from libs.dataplane.buddy import BuddyAllocator
from libs.dataplane.errors import ArenaFullError
from libs.protocol.ids import ModelKey
from libs.protocol.messages import Dispatch, NodeTiming, TensorInput, TensorListInput
from libs.protocol.tensor_meta import TensorMeta
from libs.sim.profile import Profile
from services.executor.callbacks import CallbackBox
from services.executor.outcome import NodeError, NodeOutcome, Png


@dataclass(frozen=True)
class SimTransport:
    kind: str
    address: str


class SimStore:
    """Data-plane metadata without bytes: offsets from a buddy allocator, refcounts, groups."""

    def __init__(self, executor_id: str, capacity: int) -> None:
        self.executor_id = executor_id
        self.transport = SimTransport("sim", f"sim:{executor_id}")
        self._alloc = BuddyAllocator(capacity)
        self._live: dict[str, tuple[int, int, str]] = {}  # tensor id -> (offset, refcount, group)
        self._lock = threading.Lock()

    def put(self, tid: str, nbytes: int, consumers: int, group: str) -> TensorMeta:
        with self._lock:
            if tid in self._live:  # a retried node replaces its earlier output
                self._alloc.free(self._live.pop(tid)[0])
            offset = self._alloc.alloc(nbytes)
            self._live[tid] = (offset, consumers, group)
        return TensorMeta(
            tid, self.executor_id, "sim", self.transport.address, offset, nbytes, "uint8", [nbytes]
        )

    def release(self, tensor_id: str, count: int = 1) -> bool:
        with self._lock:
            entry = self._live.get(tensor_id)
            if entry is None:
                return False
            offset, refs, group = entry
            if refs - count > 0:
                self._live[tensor_id] = (offset, refs - count, group)
                return False
            del self._live[tensor_id]
            self._alloc.free(offset)
            return True

    def discard(self, tensor_id: str) -> bool:
        """Free ``tensor_id`` now, whatever releases it still expects (``TensorStore.discard``)."""
        with self._lock:
            entry = self._live.pop(tensor_id, None)
            if entry is None:
                return False
            self._alloc.free(entry[0])
            return True

    def release_group(self, group: str) -> int:
        with self._lock:
            ids = [t for t, (_, _, g) in self._live.items() if g == group]
            for t in ids:
                self._alloc.free(self._live.pop(t)[0])
            return len(ids)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "capacity": self._alloc.capacity,
                "used": self._alloc.used_bytes,
                "free": self._alloc.free_bytes,
                "largest_free": self._alloc.largest_free,
                "tensors": len(self._live),
            }


class SimRunner:
    """Sleeps for a node's profiled time; models are cached LRU within the GPU memory budget."""

    def __init__(self, profile: Profile, store: SimStore, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.store = store
        self.scale = time_scale
        self.capacity_gb = profile.gpu_memory_gb.value
        self._resident: OrderedDict[ModelKey, float] = OrderedDict()  # model -> size (GB), LRU order
        self._bw = profile.transfer_gb_s.value * 1e9 if profile.transfer_gb_s else 0.0
        self.callbacks = CallbackBox()  # simulated nodes never wait for callback inputs

    def resident(self) -> list[ModelKey]:
        return list(self._resident)

    def host_report(self) -> tuple[list[ModelKey], dict[str, int]]:
        return [], {}  # simulated executors have no host tier yet

    def close(self) -> None:
        pass

    def _load(self, key: ModelKey, size_gb: float, load_s: float) -> float:
        if key in self._resident:
            self._resident.move_to_end(key)
            return 0.0
        if size_gb > self.capacity_gb:
            raise NodeError(
                f"{key} needs {size_gb} GB, more than the {self.capacity_gb} GB of the simulated GPU"
            )
        while self._resident and sum(self._resident.values()) + size_gb > self.capacity_gb:
            self._resident.popitem(last=False)  # evict the least recently used model
        self._resident[key] = size_gb
        return load_s

    async def run(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome:
        prof = self.profile.model(d.model)
        if prof is None:
            raise NodeError(f"model {d.model!r} is not in simulation profile {self.profile.name!r}")
        load_s = self._load(ModelKey(d.fn, d.model), prof.size_gb.value, prof.load_s.value)
        reads = [
            m
            for i in d.inputs.values()
            if isinstance(i, TensorInput | TensorListInput)
            for m in (i.metas if isinstance(i, TensorListInput) else [i.meta])
        ]
        remote = sum(m.nbytes for m in reads if m.executor != self.store.executor_id)
        fetch_s = remote / self._bw if self._bw else 0.0
        planned = load_s + fetch_s + prof.exec_s.value
        t0 = time.perf_counter()
        await asyncio.sleep(planned * self.scale)
        measured = (time.perf_counter() - t0) / self.scale  # in profile seconds, jitter included
        stretch = measured / planned if planned > 0 else 0.0
        node = d.ref
        group = node.attempt_ref.encode()
        outputs: dict[str, TensorMeta] = {}
        pngs: dict[str, Png] = {}
        with ExitStack() as undo:  # all or nothing, as NodeRunner stores outputs
            for plan in d.outputs:
                if plan.consumers > 0:
                    tid = node.output(plan.name).encode()
                    try:
                        outputs[plan.name] = self.store.put(tid, prof.output_bytes, plan.consumers, group)
                    except ArenaFullError as e:
                        raise NodeError(f"storing {plan.name}: {e}", retryable=True) from e
                    undo.callback(self.store.discard, tid)
                if plan.sink:
                    pngs[plan.name] = Png(blank_png(64, 64), 64, 64)
            undo.pop_all()
        timing = NodeTiming(
            load_s=load_s * stretch, fetch_s=fetch_s * stretch, exec_s=prof.exec_s.value * stretch
        )
        return NodeOutcome(outputs=outputs, pngs=pngs, timing=timing, bytes_in=remote, reads=reads)


def blank_png(width: int, height: int) -> bytes:
    """A valid grey PNG without Pillow (simulated images only need to be real PNGs)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
