"""Weight virtualisation: every loaded model's layers in a Layer Lookup Table, placed, evicted and
reloaded layer by layer, with reloads pipelined behind the first layers' compute.

The paper (ServerlessT2I, arXiv 2607.26566, §5.3, Fig. 9-left) decouples a model's logical layers
from the memory holding their weights. Here each model a ModelFn loads through
:func:`~libs.models.common.load_component` gets a :class:`~services.executor.layers.VirtualModel`
(its Layer Lookup Table, :mod:`services.executor.layers`): one ``LayerSlot`` per
layer of its converted checkpoint (a block of a ``ModuleList`` or another top-level module, in
execution order), naming the tensors of the layer, the module attributes they are bound to, and
where their bytes live:

* ``device``: a buffer of the framework's allocator (on the CPU an anonymous page-aligned mapping,
  so eviction returns the pages at once; on CUDA ``torch.empty`` on the device);
* ``arena``: a block of the data-plane arena (idle communication memory holding cached weights);
* ``none``: evicted. The parameters then point at a one-element placeholder of the right dtype and
  device, expanded to the shape (NaN for floats), so ``model.device`` and ``model.dtype`` still
  answer and a forward that ran through an evicted layer could not go unnoticed. The bytes stay in
  the box's host tier (or on disk) for the next load.

A ModelFn never notices: parameters are rebound in place (``module._parameters[name]``), ties and
``requires_grad`` flags kept, and every layer's module gets a forward pre-hook that waits for its
own weights, so a model whose first layers are resident starts computing while a loader thread
copies the rest in order (§5.1; on CUDA on a side stream, the hook then waits on the layer's
event). Which layers stay is :class:`~libs.dataplane.weights.CachePolicy`'s decision, shared with
the simulated executors; this module applies it to memory.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from libs.dataplane.errors import DataPlaneError
from libs.dataplane.loader.staging import pin_host, unpin_host
from libs.dataplane.weights import ARENA, DEVICE, LAYER, CachePolicy, Eviction, prefix_length
from services.executor.layers import PAGE, LayerLoadError, LayerSlot, VirtualModel, drop_source, same_device

log = logging.getLogger(__name__)

#: Activation room a model gets before its first run has been profiled.
DEFAULT_HEADROOM = 1 << 30
#: What a CUDA pool taken from the GPU's free memory leaves for the context and the allocator's slack.
CUDA_MARGIN = 512 << 20


def _flat(loaded: Any) -> torch.Tensor:
    """The flat uint8 host buffer a LoadedCheckpoint's tensors view."""
    for t in loaded.tensors.values():
        if t.numel():
            return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return torch.empty(0, dtype=torch.uint8)


@dataclass
class LoadReport:
    """How one acquisition brought a model onto the device."""

    seconds: float = 0.0  # before execute could start (plus, after the run, the stalls in it)
    tier: str = ""  # "" (all resident), "host" or "disk"
    disk_bytes: int = 0
    frac: float = 0.0  # fraction of the model's bytes loaded
    layers: int = 0  # layers loaded


class LoadJob:
    """Copies a model's missing layers into their new buffers, in order, on a loader thread."""

    def __init__(self, cache: WeightCache, vm: VirtualModel, layers: list[int]) -> None:
        self.cache = cache
        self.vm = vm
        self.layers = layers
        self.error: BaseException | None = None
        self.tier = "host"
        self.disk_bytes = 0
        self.load_s: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="t2i-weights", daemon=True)

    def start(self) -> None:
        if self.layers:
            self._thread.start()

    def thread_join(self) -> None:
        if self.layers:
            self._thread.join()

    def wait(self) -> None:
        if self.layers:
            self._thread.join()
        if self.error is not None:
            raise LayerLoadError(f"loading {self.vm.key}: {self.error}") from self.error

    def _run(self) -> None:
        vm = self.vm
        opened: list[Any] = []
        pinned: list[int] = []  # addresses registered with cudaHostRegister (0: not pinned)
        stream = self.cache.side_stream()
        try:
            sources: dict[int, Any] = {}
            flats: dict[int, torch.Tensor] = {}
            last = time.perf_counter()
            for i in self.layers:
                slot = vm.slots[i]
                c = slot.component
                if c not in sources:
                    src = vm.sources.pop(c, None)
                    if src is None:  # a reload: only the component's missing suffix
                        comp = vm.components[c]
                        src = vm.loader.load(comp.path, "cpu", background=True, first_layer=i - comp.first)
                    opened.append(src)
                    sources[c] = src
                src = sources[c]
                src.wait_layer(slot.name)
                if slot.tensors:
                    if c not in flats:
                        flats[c] = _flat(src)
                        if stream is not None:  # CUDA: DMA from pinned pages, truly asynchronous
                            lo, hi = self._span(c)
                            block = getattr(src, "host_block", None)
                            read_only = block is not None and block.buf.readonly
                            pinned.append(pin_host(flats[c].data_ptr() + lo, hi - lo, read_only))
                    self.cache.fill(vm, i, flats[c], stream)
                slot.filled = True
                slot.ready.set()
                now = time.perf_counter()
                self.load_s[i] = now - last
                last = now
            for src in opened:
                src.wait()
                if src.source != "host":
                    self.tier = "disk"
                self.disk_bytes += src.bytes_from_disk
        except BaseException as e:  # noqa: BLE001 - reported by wait(); waiting hooks are released
            self.error = e
        finally:
            if any(pinned):
                stream.synchronize()  # the copies out of the pinned pages are done
                for addr in pinned:
                    unpin_host(addr)
            for i in self.layers:
                vm.slots[i].ready.set()
            for src in opened:
                drop_source(src)

    def _span(self, component: int) -> tuple[int, int]:
        """The bytes of ``component``'s flat host buffer this job copies: from its first layer's
        start to its last layer's end."""
        slots = [self.vm.slots[i] for i in self.layers if self.vm.slots[i].component == component]
        return min(s.base for s in slots), max(s.end for s in slots)


class WeightCache:
    """One executor's device memory for model weights: a :class:`CachePolicy` applied to real
    buffers. Thread-safe; the node thread acquires and releases, loader threads fill, and a
    communication allocation in the arena may reclaim weights (:meth:`reclaim`)."""

    def __init__(
        self,
        device: torch.device | str,
        budget: int,
        *,
        loader: Any,
        arena: Any = None,
        arena_budget: int = 0,
        kind: str = "cpu",
        keep: Callable[[Hashable, list[int]], int | None] | None = None,
        granularity: str = LAYER,
        pool: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.unlimited = budget <= 0
        self.configured = budget  # the operator's bound on cached weights
        # The device memory this executor's weights and activations share (bytes): counted by the
        # cache itself, never read back through the caching allocator (whose freed blocks stay
        # reserved). On CUDA, unless given, what the GPU had free when the cache was made (the device
        # arena is allocated before it) less a margin for the CUDA context's own allocations. None
        # (the CPU's default): weights are bounded by ``budget`` alone.
        if pool is None and self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            pool = max(0, free - CUDA_MARGIN)
        self.pool = pool
        # Peak bytes allocated by one run of each model beyond its weights (its activations, outputs
        # included), from its runs so far (record_activation); until a model has run, the default.
        self.activation: dict[Hashable, int] = {}
        self.default_headroom = DEFAULT_HEADROOM
        if arena is not None and not same_device(torch.device(arena.device), self.device):
            # Idle communication memory is a weight cache only on the weights' own device: a CUDA
            # executor's host arena would hand its layers CPU memory (bound, they break the model).
            log.info("the %s arena holds no cached weights for %s modules", arena.device, self.device)
            arena = None
        self.policy = CachePolicy(
            budget if budget > 0 else 1 << 62, arena_budget if arena is not None else 0, granularity
        )
        self.loader = loader
        self.arena = arena
        self.kind = kind
        self.keep_override = keep
        self.pipelined = True  # False: a load completes before the model runs (no overlap)
        self.models: dict[Hashable, VirtualModel] = {}
        self.profiles: dict[tuple[Hashable, str], dict[str, list[float]]] = {}
        self._lock = threading.RLock()
        self._stream: Any = None
        self.evictions = 0
        if arena is not None and hasattr(arena, "set_reclaimer"):
            arena.set_reclaimer(self.reclaim)

    # -- models ----------------------------------------------------------------------------------
    def add(
        self, key: Hashable, components: dict[str, Any], loader: Any = None, group: Hashable = None
    ) -> VirtualModel:
        """Take over the layers of ``components`` (just loaded: their checkpoints are the sources of
        the first copy); ``loader`` reloads evicted layers later (the cache's own if None); ``group``
        is the model's workflow (the WCache deployment mode evicts a workflow's models together)."""
        vm = VirtualModel(key, components, self.device)
        vm.loader = loader if loader is not None else self.loader
        with self._lock:
            self.models[key] = vm
            keep = self.keep_override(key, vm.sizes()) if self.keep_override else None
            self.policy.add(key, vm.sizes(), keep, group=group)
        return vm

    def begin_request(self, request_id: str) -> None:
        """A node of ``request_id`` is about to run (NoCache: another request's models go first)."""
        with self._lock:
            for ev in self.policy.begin_request(request_id):
                self._apply_eviction(ev)

    def end_request(self, request_id: str) -> None:
        """``request_id`` ended (NoCache: nothing of it stays on the device)."""
        with self._lock:
            for ev in self.policy.end_request(request_id):
                self._apply_eviction(ev)

    def begin(self, key: Hashable) -> tuple[LoadJob, LoadReport]:
        """Pin ``key``, make room, place its missing layers and start copying them in; the model
        may execute at once (its hooks wait per layer). End with :meth:`end`."""
        t0 = time.perf_counter()
        vm = self.models[key]
        with self._lock:
            self._refresh_budget(key)
            before = self.policy.resident(key)

            def try_arena(layer: int, nbytes: int) -> bool:
                return self._take_arena(vm.slots[layer])

            evicted: list[Eviction] = []

            def evict(ev: Eviction) -> None:
                evicted.append(ev)
                self._apply_eviction(ev)

            placements = self.policy.acquire(key, evict, try_arena)
            if self.pool is not None:  # resident others that stand in the way of its activations
                for ev in self.policy.over_budget():
                    evict(ev)
            for i, region in placements:
                self._allocate(vm, i, region)
            for i, _ in placements:
                vm.slots[i].ready.clear()
                vm.slots[i].filled = False
        if evicted:
            log.info(
                "evicted %d layers (%d bytes) of %s to place %s",
                len(evicted), sum(ev.nbytes for ev in evicted), sorted({str(ev.key) for ev in evicted}), key,
            )  # fmt: skip
        missing = [i for i, _ in placements]
        total = vm.nbytes
        report = LoadReport(
            frac=(sum(vm.slots[i].nbytes for i in missing) / total) if total else 0.0,
            layers=len(missing),
        )
        vm.stall_s = 0.0
        vm.profiling = (key, self.kind) not in self.profiles and before == 0 and bool(missing)
        if vm.profiling:
            vm.comp_s = [0.0] * len(vm.slots)
        job = LoadJob(self, vm, missing)
        job.start()
        if not self.pipelined:  # every layer first, then the forward (a baseline for benchmarks)
            job.thread_join()
        try:
            self._wait_direct(vm, set(missing))
        except LayerLoadError:
            self.end(key, job, report)  # unpins; raises the load's own error
            raise
        report.seconds = time.perf_counter() - t0
        return job, report

    def _wait_direct(self, vm: VirtualModel, missing: set[int]) -> None:
        """Wait for the layers whose tensors code may read outside a forward, where no hook waits
        (:attr:`VirtualModel.direct`), so execute finds them loaded."""
        for i in vm.direct:
            if i not in missing:
                continue
            slot = vm.slots[i]
            slot.ready.wait()
            if not slot.filled:
                raise LayerLoadError(f"layer {slot.name} of {vm.key} was not loaded")
            if slot.event is not None:
                torch.cuda.current_stream(self.device).wait_event(slot.event)

    def end(self, key: Hashable, job: LoadJob, report: LoadReport) -> None:
        """After the run (however it went): wait for the copies, unpin, keep the profile, trim."""
        vm = self.models[key]
        try:
            job.wait()
            if job.layers:
                report.tier = job.tier
                report.disk_bytes = job.disk_bytes
            if vm.profiling:
                self._profile(vm, job)
        except LayerLoadError:
            with self._lock:  # what did not land is not resident
                filled = 0
                while filled < len(vm.slots) and vm.slots[filled].filled:
                    filled += 1
                for ev in self.policy.shrink(key, filled, force=True):
                    self._apply_eviction(ev)
            raise
        finally:
            vm.profiling = False
            with self._lock:
                self.policy.unpin(key)
                self._refresh_budget()
                for ev in self.policy.over_budget():
                    self._apply_eviction(ev)

    def _profile(self, vm: VirtualModel, job: LoadJob) -> None:
        """Keep the first load's per-layer times and set the model's Lₑ′ from them. A load's time to
        its first byte is paid by whichever layer loads first, so it is split off: the layers load
        at the bandwidth the others achieved, plus a ``startup`` latency once per load."""
        loads = [job.load_s.get(i, 0.0) for i in range(len(vm.slots))]
        sizes = vm.sizes()
        prof = self.profiles.setdefault((vm.key, self.kind), {})
        prof[job.tier] = loads
        prof["comp"] = list(vm.comp_s)
        rest_bytes, rest_s = sum(sizes[1:]), sum(loads[1:])
        startup = 0.0
        if rest_bytes and rest_s > 0 and loads:
            per_byte = rest_s / rest_bytes
            startup = max(0.0, loads[0] - sizes[0] * per_byte)
            loads = [b * per_byte for b in sizes]
        prof["startup"] = [startup]
        if self.keep_override is None:
            keep = prefix_length(loads, vm.comp_s, startup)
            with self._lock:
                self.policy.set_keep(vm.key, keep)
            log.info("%s: %d layers, keeps %d first (Le' from %s loads)", vm.key, len(loads), keep, job.tier)

    def remove(self, key: Hashable) -> None:
        """Forget ``key`` (unpinned): its layers are freed and its hooks removed."""
        with self._lock:
            vm = self.models.get(key)
            if vm is None:
                return
            for ev in self.policy.remove(key):
                self._apply_eviction(ev)
            del self.models[key]
        vm.close()

    def trim(self, key: Hashable, resident: int) -> None:
        """Evict ``key``'s top layers until ``resident`` remain (benchmarks and tests)."""
        with self._lock:
            for ev in self.policy.shrink(key, resident):
                self._apply_eviction(ev)

    def reclaim(self, nbytes: int) -> int:
        """A communication allocation needs ``nbytes`` of the arena: give it cached weights (never
        those of a model that is executing). Returns the arena bytes freed."""
        with self._lock:
            evictions = self.policy.reclaim(ARENA, nbytes)
            for ev in evictions:
                self._apply_eviction(ev)
        freed = sum(ev.nbytes for ev in evictions if ev.region == ARENA)
        if evictions:
            log.info("communication reclaimed %d arena bytes of cached weights", freed)
        return freed

    def snapshot(self) -> dict[Hashable, tuple[int, int, int, int]]:
        with self._lock:
            return self.policy.snapshot()

    def resident_bytes(self) -> int:
        with self._lock:
            return self.policy.used[DEVICE] + self.policy.used[ARENA]

    # -- memory ----------------------------------------------------------------------------------
    def side_stream(self) -> Any:
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    # -- activations -----------------------------------------------------------------------------
    def headroom(self, key: Hashable) -> int:
        """The device memory ``key``'s next run needs beyond its weights: its profiled peak."""
        return self.activation.get(key, self.default_headroom)

    def record_activation(self, key: Hashable, nbytes: int) -> None:
        """A run of ``key`` allocated at most ``nbytes`` beyond what was allocated when it began (the
        runner measures it on CUDA); the largest seen is what its next runs leave room for."""
        with self._lock:
            self.activation[key] = max(int(nbytes), self.activation.get(key, 0))

    def room(self) -> int | None:
        """Device memory of the pool not held by weights now (None without a pool)."""
        if self.pool is None:
            return None
        with self._lock:
            return self.pool - self.policy.used[DEVICE]

    def short_of(self, key: Hashable) -> bool:
        """Whether ``key``'s profiled activations do not fit beside the weights resident now (a VAE
        decode then tiles: services/executor/runtime.py)."""
        room = self.room()
        return room is not None and key in self.activation and self.activation[key] > room

    def _refresh_budget(self, key: Hashable = None) -> None:
        """With a pool, the weights' region is the pool less the activations of the model about to
        run (its profiled peak: placing it evicts what stands in the way of both); between runs
        (``key`` None) the whole pool, so that a model whose activations needed its neighbours' room
        keeps its own weights once it is done."""
        if self.pool is None:
            return
        room = max(0, self.pool - (self.headroom(key) if key is not None else 0))
        self.policy.budgets[DEVICE] = room if self.unlimited else min(self.configured, room)

    def _take_arena(self, slot: LayerSlot) -> bool:
        """A block of the arena for ``slot`` (False when communication holds the space)."""
        if self.arena is None:
            return False
        if slot.nbytes == 0:
            return True
        try:  # at least a page: blocks of a page or more are page-aligned (the residues hold)
            slot.arena_offset = self.arena.allocate(max(slot.nbytes, PAGE), timeout=None, reclaim=False)
        except DataPlaneError:
            return False
        return True

    def _allocate(self, vm: VirtualModel, i: int, region: str) -> None:
        slot = vm.slots[i]
        slot.where = region
        if slot.nbytes == 0:
            return
        if region == ARENA:
            assert slot.arena_offset is not None
            slot.storage = self._arena_tensor(slot.arena_offset, slot.nbytes)
        else:
            slot.storage = self._device_buffer(slot.nbytes)

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            mem = mmap.mmap(-1, nbytes)  # page-aligned; unmapped when the last view goes
            return torch.frombuffer(mem, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _arena_tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        if not self.arena.holds_tensors:
            return torch.frombuffer(self.arena.view(offset, nbytes), dtype=torch.uint8)
        return self.arena.tensor(offset, nbytes)

    def fill(self, vm: VirtualModel, i: int, flat: torch.Tensor, stream: Any) -> None:
        """Copy layer ``i`` from the checkpoint's flat host buffer into its buffer and bind it."""
        slot = vm.slots[i]
        dst = slot.storage
        assert dst is not None, f"layer {slot.name} has no buffer"
        if self.device.type == "cpu":
            n = slot.end - slot.base
            dst[:n].copy_(flat[slot.base : slot.end])
        else:
            dst.record_stream(stream)  # written there: the allocator must not reuse it before
            with torch.cuda.stream(stream):
                for t in slot.tensors:
                    dst[t.at : t.at + t.nbytes].copy_(flat[t.flat : t.flat + t.nbytes], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            slot.event = ev
        with self._lock:
            vm.bind(i, dst)

    def _apply_eviction(self, ev: Eviction) -> None:
        vm = self.models[ev.key]
        slot = vm.slots[ev.layer]
        vm.unbind(ev.layer)
        slot.ready.clear()
        slot.filled = False
        slot.event = None
        slot.storage = None
        if slot.arena_offset is not None:
            self.arena.free(slot.arena_offset)
            slot.arena_offset = None
        slot.where = "none"
        self.evictions += 1
