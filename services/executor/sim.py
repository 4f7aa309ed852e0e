"""Simulated executors: replay profiled load and compute times instead of computing.

A simulated executor is the real :class:`~services.executor.service.ExecutorService` (registration,
heartbeats, dispatch acks, completions, releases) with two parts swapped:

* :class:`SimRunner` sleeps for the node model's profiled time — plus the part of loading its missing
  layers that computing does not hide — and reports the measured sleep (divided by the time scale)
  as the node's GPU time. Which layers stay resident is decided by the real executors' policy
  (:class:`~libs.dataplane.weights.CachePolicy`: prefixes of uniform layers, LRU across models,
  bounded by the profile's GPU memory, spilling into the profile's share of the arena);
* :class:`SimStore` keeps the data plane's *metadata*: outputs get real buddy-allocated offsets in a
  virtual arena and refcounts, released as consumers read them, so placement by input locality and
  arena pressure behave as on a real executor; no bytes exist. Cached weights placed in the arena
  get blocks too, and a tensor that finds the arena full takes them back first.

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
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

from libs.dataplane.buddy import BuddyAllocator
from libs.dataplane.errors import ArenaFullError
from libs.dataplane.weights import (
    ARENA,
    LAYER,
    CachePolicy,
    Eviction,
    cache_granularity,
    cache_key,
    per_model,
    pipelined_seconds,
    prefix_length,
)
from libs.protocol.ids import ModelKey
from libs.protocol.messages import Dispatch, NodeTiming, TensorInput, TensorListInput
from libs.protocol.tensor_meta import TensorMeta
from libs.sim.profile import ModelProfile, Profile
from services.executor.callbacks import CallbackBox
from services.executor.outcome import NodeError, NodeOutcome, Png

GB = 1e9  # profiles give sizes in GB (10^9 bytes)
# Simulated work shorter than this (in real seconds, after the time scale) is not slept: the runner
# yields to the event loop once and reports the profiled time. Only tiny time scales (bench/scale.py)
# get there; it changes the simulation alone (docs/scheduling.md, "Control-plane speed").
YIELD_BELOW_S = 0.001


@dataclass(frozen=True)
class SimTransport:
    kind: str
    address: str


class SimStore:
    """Data-plane metadata without bytes: offsets from a buddy allocator, refcounts, groups.

    Cached weights may hold arena blocks too (:meth:`alloc_weights`); ``reclaim`` (set by the
    :class:`SimRunner` that caches them) frees some when a tensor does not fit."""

    def __init__(self, executor_id: str, capacity: int) -> None:
        self.executor_id = executor_id
        self.transport = SimTransport("sim", f"sim:{executor_id}")
        self._alloc = BuddyAllocator(capacity)
        self._live: dict[str, tuple[int, int, str]] = {}  # tensor id -> (offset, refcount, group)
        self._weights: set[int] = set()  # offsets of blocks holding cached weights
        # Frees cached weights in the arena for a tensor of n bytes; returns the bytes freed.
        self.reclaim: Callable[[int], int] | None = None
        self._lock = threading.RLock()  # reentrant: put -> reclaim -> free_weights

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    def put(self, tid: str, nbytes: int, consumers: int, group: str) -> TensorMeta:
        with self._lock:
            if tid in self._live:  # a retried node replaces its earlier output
                self._alloc.free(self._live.pop(tid)[0])
            while True:
                try:
                    offset = self._alloc.alloc(nbytes)
                    break
                except ArenaFullError:
                    # communication comes first: cached weights give their arena blocks back, as
                    # long as there are any (fragmentation may need more than nbytes of them)
                    if self.reclaim is None or self.reclaim(nbytes) <= 0:
                        raise
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

    def alloc_weights(self, nbytes: int) -> int:
        """A block for a cached layer; raises :class:`ArenaFullError` when none fits."""
        with self._lock:
            offset = self._alloc.alloc(nbytes)
            self._weights.add(offset)
            return offset

    def free_weights(self, offset: int) -> None:
        with self._lock:
            self._weights.remove(offset)
            self._alloc.free(offset)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "capacity": self._alloc.capacity,
                "used": self._alloc.used_bytes,
                "free": self._alloc.free_bytes,
                "largest_free": self._alloc.largest_free,
                "tensors": len(self._live),
                "weight_blocks": len(self._weights),
            }


class SimRunner:
    """Sleeps for a node's profiled time; models' layers are cached by the executors' policy.

    Each model is ``layers`` uniform layers (:class:`~libs.sim.profile.ModelProfile`). A node pins
    its model, places the missing layers (evicting others' top layers, LRU model first, down to their
    prefixes), and is charged the load its compute cannot hide: ``pipelined_seconds(load, comp,
    resident) - Σ comp``, 0 when every layer was resident.

    ``granularity`` is the policy's unit (``layer``, or a deployment-mode baseline's ``model``,
    ``workflow``, ``none``: :mod:`libs.dataplane.weights.policy`), exactly as on a real executor."""

    cancels_cleanly = True  # a simulated node is an asyncio sleep: a time limit just cancels it
    host_report_blocks = False  # no host tier: heartbeats read the (empty) report on the loop

    def __init__(
        self, profile: Profile, store: SimStore, time_scale: float = 1.0, granularity: str = LAYER
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.store = store
        self.scale = time_scale
        self.capacity_gb = profile.gpu_memory_gb.value
        self.policy = CachePolicy(
            device_budget=round(self.capacity_gb * GB),
            arena_budget=int(profile.arena_weights * store.capacity),
            granularity=granularity,
        )
        # Keyed by the policy's cache key: the ModelKey, or (workflow, ModelKey) under ``workflow``.
        self._times: dict[object, tuple[list[float], list[float]]] = {}  # per-layer load, comp
        self._arena: dict[tuple[object, int], int] = {}  # (cache key, layer) -> arena block offset
        self._bw = profile.transfer_gb_s.value * 1e9 if profile.transfer_gb_s else 0.0
        self.callbacks = CallbackBox()  # simulated nodes never wait for callback inputs
        store.reclaim = self.reclaim_arena

    def resident(self) -> list[ModelKey]:
        """Models with every layer on the device, least recently used first."""
        return [k for k, (n, layers, _, _) in self.cached().items() if n == layers]

    def host_report(self) -> tuple[list[ModelKey], dict[str, int]]:
        return [], {}  # simulated executors have no host tier yet

    def cached(self) -> dict[ModelKey, tuple[int, int, int, int]]:
        """Per model with any layer on the device: (resident layers, layers, resident bytes, bytes)."""
        return per_model(self.policy.snapshot())  # type: ignore[return-value]  # keys are ModelKeys

    def follow(self, deployment: str) -> bool:
        return self.policy.regranulate(cache_granularity("", deployment))

    def request_ended(self, request_id: str) -> None:
        """The scheduler released ``request_id``: under NoCache nothing of it stays on the device."""
        for ev in self.policy.end_request(request_id):
            self._evicted(ev)

    def reclaim_arena(self, nbytes: int) -> int:
        """Communication needs ``nbytes`` of the arena: evict cached layers there (never those of a
        running node); returns the arena bytes freed (0 when none were left)."""
        if not self._arena:
            return 0  # no cached layer in the arena
        freed = 0
        for ev in self.policy.reclaim(ARENA, nbytes):
            self._evicted(ev)
            if ev.region == ARENA:
                freed += ev.nbytes
        return freed

    def close(self) -> None:
        pass

    def _known(self, key: object, prof: ModelProfile, group: str = "") -> None:
        if key in self.policy:
            return
        if prof.layer_bytes:  # measured layers: each loads in its share of the time by size
            sizes = list(prof.layer_bytes)
            n, total = len(sizes), sum(sizes)
            load = [prof.load_s.value * b / total if total else 0.0 for b in sizes]
        else:
            n = prof.layers
            base, extra = divmod(round(prof.size_gb.value * GB), n)
            sizes = [base + (1 if i < extra else 0) for i in range(n)]  # sums to the model's bytes
            load = [prof.load_s.value / n] * n
        comp = [prof.exec_s.value / n] * n
        self.policy.add(key, sizes, keep=prefix_length(load, comp), group=group)
        self._times[key] = (load, comp)

    def _to_arena(self, key: object, layer: int, nbytes: int) -> bool:
        try:
            offset = self.store.alloc_weights(nbytes)
        except ArenaFullError:
            return False  # communication holds the space: the layer goes to the device region
        self._arena[(key, layer)] = offset
        return True

    def _evicted(self, ev: Eviction) -> None:
        if ev.region == ARENA:
            self.store.free_weights(self._arena.pop((ev.key, ev.layer)))

    def _acquire(self, key: object, prof: ModelProfile, group: str = "") -> tuple[float, float, bool]:
        """Pin ``key`` with every layer resident; (exposed load seconds, fraction of its bytes
        loaded, whether anything loaded)."""
        if prof.size_gb.value > self.capacity_gb:
            raise NodeError(
                f"{key} needs {prof.size_gb.value} GB, more than the {self.capacity_gb} GB of the "
                "simulated GPU"
            )
        self._known(key, prof, group)
        load, comp = self._times[key]
        before = self.policy.resident(key)
        try:
            placements = self.policy.acquire(key, evict=self._evicted, try_arena=partial(self._to_arena, key))
        except BaseException:
            self.policy.unpin(key)
            raise
        if not placements:
            return 0.0, 0.0, False
        sizes = self.policy.sizes(key)
        loaded = sum(sizes[layer] for layer, _ in placements)
        total = sum(sizes)
        exposed = max(0.0, pipelined_seconds(load, comp, before) - sum(comp))
        return exposed, min(1.0, loaded / total) if total else 0.0, bool(loaded) or exposed > 0

    def _release(self, key: object) -> None:
        self.policy.unpin(key)
        for ev in self.policy.over_budget():  # a model that ran over the budget gives layers back
            self._evicted(ev)

    async def run(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome:
        prof = self.profile.model(d.model)
        if prof is None:
            raise NodeError(f"model {d.model!r} is not in simulation profile {self.profile.name!r}")
        key = cache_key(self.policy.granularity, d.workflow, ModelKey(d.fn, d.model))
        for ev in self.policy.begin_request(d.request_id):  # NoCache: a new request starts cold
            self._evicted(ev)
        reads = [
            m
            for i in d.inputs.values()
            if isinstance(i, TensorInput | TensorListInput)
            for m in (i.metas if isinstance(i, TensorListInput) else [i.meta])
        ]
        remote = sum(m.nbytes for m in reads if m.executor != self.store.executor_id)
        fetch_s = remote / self._bw if self._bw else 0.0
        load_s, load_frac, loaded = self._acquire(key, prof, d.workflow)  # pinned until its compute is done
        try:
            planned = load_s + fetch_s + prof.exec_s.value
            if planned * self.scale < YIELD_BELOW_S:
                # A timer this short would last >= 1 ms anyway (the event loop's epoll timeout has
                # millisecond resolution): yield once instead, and report the profiled time.
                await asyncio.sleep(0)
                measured = planned
            else:
                t0 = time.perf_counter()
                await asyncio.sleep(planned * self.scale)
                measured = (time.perf_counter() - t0) / self.scale  # profile seconds, jitter included
        finally:
            self._release(key)  # before storing outputs, which may take back its arena layers
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
            load_s=load_s * stretch,
            fetch_s=fetch_s * stretch,
            exec_s=prof.exec_s.value * stretch,
            load_tier="host" if loaded else "",  # the simulation loads from pinned host memory
            load_frac=load_frac,
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
