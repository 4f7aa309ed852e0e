"""Running one node on this executor: load the model once, pull inputs, execute, store outputs.

This is the torch side of the executor; it runs in the executor's single worker thread so the
asyncio loop stays free for heartbeats and releases. Everything a node needs arrives in its
``Dispatch``: constants, and tensor metadata that the data plane turns into tensors (a zero-copy
view when the producer was this executor, a one-sided pull into our arena otherwise, paper §5.2).
Inputs declared ``callback=True`` arrive as :class:`~libs.workflow.modelfn.Deferred` and are pulled
only when ``execute`` reaches the point that needs them.

A node runs in three steps (:meth:`NodeRunner.run_sync`): ``_bind_inputs``, ``_execute``,
``_store_outputs``. What a step acquires is handed to an ``ExitStack`` as it is acquired, so every
way out of the run, success or failure, gives it back: pulled input copies are freed, callback
deliveries for the node are forgotten, and outputs already stored are discarded when a later output
(or its PNG) fails.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.dataplane.errors import DataPlaneError, PeerBusyError, TransportError
from libs.dataplane.store import Lease, TensorStore
from libs.dataplane.weights import cache_granularity, cache_key, model_of, per_model
from libs.errors import is_retryable
from libs.models.families import DTYPES, device_dtype, family_of_fn, parse_dtypes  # noqa: F401 - re-exported
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import (
    ConstInput,
    Dispatch,
    ImageInput,
    LoraInput,
    NodeTiming,
    PendingInput,
    TensorInput,
    TensorListInput,
)
from libs.protocol.tensor_meta import TensorMeta
from libs.workflow import catalog
from libs.workflow.modelfn import Deferred, ModelFn
from libs.workflow.paths import resolve_lora_path, resolve_model_path
from services.executor.activations import ActivationProfile, tile_if_short
from services.executor.callbacks import CallbackBox
from services.executor.images import decode_image, encode_png
from services.executor.outcome import NodeError, NodeOutcome, Png
from services.executor.weights import LayerLoadError, LoadReport, WeightCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLoad:
    """How one model got onto this executor for a node: seconds (before execute, plus execute's
    waits for layers still loading), the tier it was read from, disk bytes, and the fraction of the
    model's bytes loaded (0 when every layer was resident)."""

    seconds: float = 0.0
    tier: str = ""  # "" (already resident), "host" (the box's host tier) or "disk"
    disk_bytes: int = 0
    frac: float = 0.0
    stall_s: float = 0.0  # of ``seconds``: waited inside execute for layers still loading


class _HostStaging:
    """The loader a ModelFn's ``load_model`` gets: checkpoints land in host memory, in the
    background (the :class:`~services.executor.weights.WeightCache` copies them onto the device
    layer by layer while the first layers already run). ``sync`` loads in the foreground, so
    ``load_component``'s own recovery from a corrupt checkpoint applies (after a failed load)."""

    def __init__(self, base: Any, sync: bool = False) -> None:
        self._base = base
        self._sync = sync

    def load(self, ckpt_dir: Any, device: Any = "cpu", background: bool = False, tags: Any = ()) -> Any:
        return self._base.load(ckpt_dir, "cpu", background=not self._sync, tags=tags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)  # chunk_bytes, dtype, counters, host_tier


#: What the executor caches a model's components under: the model, or ``(workflow, model)`` under
#: the WCache deployment mode (a copy per workflow: ``libs.dataplane.weights.cache_key``).
CacheKey = ModelKey | tuple[str, ModelKey]


def model_in(key: CacheKey) -> ModelKey:
    """The model a :data:`CacheKey` caches."""
    return model_of(key)  # type: ignore[return-value]


@dataclass
class Acquired:
    """A model held for one node run (:meth:`ModelCache.acquire` / :meth:`ModelCache.release`)."""

    key: CacheKey
    components: dict[str, Any]
    job: Any = None  # the WeightCache's LoadJob (None: a model without virtualised layers)
    report: LoadReport = field(default_factory=LoadReport)


class ModelCache:
    """ModelFn instances and their loaded components; the components' weights live in a
    :class:`~services.executor.weights.WeightCache` (layer by layer, evicted under pressure).

    Components load through ``loader`` (a :class:`~libs.dataplane.loader.Loader`, usually over the
    box's host tier): ModelFns whose ``load_model`` accepts a ``loader`` get it, tagged with the
    model's key so the host tier can tell every executor of the box which models it holds.
    ``budget`` bounds the bytes of cached weights on the device (0: no bound on the CPU); ``pool``
    is the device memory weights and activations share (on CUDA by default what the GPU had free at
    start: WeightCache), each model's run leaving room for its profiled activations; ``arena`` and
    ``arena_budget`` let cached weights use idle arena space, which communication takes back.
    """

    def __init__(
        self,
        root: Path,
        device: str,
        loader: Any = None,
        dtypes: dict[str, str] | None = None,
        *,
        budget: int = 0,
        arena: Any = None,
        arena_budget: int = 0,
        kind: str = "",
        keep: Any = None,
        granularity: str = "layer",
        pool: int | None = None,
    ) -> None:
        self.root = root
        self.device = device
        self.loader = loader
        self.dtypes = dict(dtypes or {})  # model name (or "*") -> dtype its components load in
        self.weights = WeightCache(
            device, budget, loader=loader, arena=arena, arena_budget=arena_budget,
            kind=kind or torch.device(device).type, keep=keep, granularity=granularity, pool=pool,
        )  # fmt: skip
        self._fns: dict[str, ModelFn] = {}
        self._takes_loader: dict[str, bool] = {}
        # Keyed by the cache key: the ModelKey, or (workflow, ModelKey) under the WCache deployment
        # mode (a copy of the model per workflow, as separate GPU functions would hold).
        self._components: dict[CacheKey, dict[str, Any]] = {}
        self._sync_next: set[CacheKey] = set()  # reload in the foreground after a failed load
        self._lock = threading.Lock()

    def fn(self, name: str) -> ModelFn:
        inst = self._fns.get(name)
        if inst is None:
            try:
                inst = catalog.load_class(name)()
            except catalog.UnknownModelFn as e:
                raise NodeError(str(e)) from None
            self._fns[name] = inst
        return inst

    def acquire(self, fn: str, model: str, workflow: str = "") -> Acquired:
        """The components of ``fn`` for ``model``, held for one run: loaded on first use (the
        ModelFn's ``load_model(model_path, device, loader=...)``), their missing layers placed and
        being copied in (execute may start at once). Always end with :meth:`release`. ``workflow``
        is the request's (WCache keeps a copy per workflow)."""
        key: CacheKey = cache_key(self.weights.policy.granularity, workflow, ModelKey(fn, model))  # type: ignore[assignment]
        t0 = time.perf_counter()
        comps = self._components.get(key)
        first = comps is None
        if comps is None:
            comps = self._load(key)
        report = LoadReport()
        if key in self.weights.models:
            try:
                job, report = self.weights.begin(key)
            except LayerLoadError as e:
                self._forget(key)
                raise NodeError(str(e), retryable=True) from e
            if first:
                report.seconds = time.perf_counter() - t0
            return Acquired(key, comps, job, report)
        if first:  # nothing to virtualise (no checkpoint through the loader): loaded whole, now
            report = LoadReport(seconds=time.perf_counter() - t0, tier="disk", frac=1.0)
        return Acquired(key, comps, None, report)

    def components(self, fn: str, model: str) -> tuple[dict[str, Any], ModelLoad]:
        """The components of ``fn`` for ``model`` with every layer loaded, and how they were loaded
        (``ModelLoad()`` when they were resident already): :meth:`acquire` then :meth:`release`."""
        held = self.acquire(fn, model)
        return held.components, self.release(held)

    def release(self, held: Acquired) -> ModelLoad:
        """After the run: the load as it went (the layers' copies waited for; execute's waits for
        them counted as loading), the model unpinned and the cache trimmed to its budget. Raises
        NodeError when a layer could not be loaded."""
        report = held.report
        vm = self.weights.models.get(held.key)
        stall_s = vm.stall_s if vm is not None and held.job is not None else 0.0
        if held.job is not None:
            try:
                self.weights.end(held.key, held.job, report)
            except LayerLoadError as e:
                self._forget(held.key)
                raise NodeError(str(e), retryable=True) from e
        return ModelLoad(report.seconds + stall_s, report.tier, report.disk_bytes, report.frac, stall_s)

    def _load(self, ckey: CacheKey) -> dict[str, Any]:
        key = model_in(ckey)
        inst = self.fn(key.fn)
        path = resolve_model_path(key.model, self.root)
        loader = self.loader
        try:
            if loader is not None and self._accepts_loader(key.fn, inst):
                dtype = self.dtypes.get(key.model, self.dtypes.get("*")) or default_dtype(inst, self.device)
                tagged = loader.tagged([key.encode()], dtype)
                staging = _HostStaging(tagged, sync=ckey in self._sync_next)
                comps = inst.load_model(path, self.device, loader=staging)
                self._sync_next.discard(ckey)
                group = ckey[0] if ckey is not key else None
                self.weights.add(ckey, comps, loader=tagged, group=group)
            else:
                comps = inst.load_model(path, self.device)
        except (OSError, ValueError) as e:
            raise NodeError(f"{key.fn} cannot load model {key.model!r} (from {path!r}): {e}") from e
        with self._lock:
            self._components[ckey] = comps
        log.info("loaded %s (%d layers)", ckey, len(getattr(self.weights.models.get(ckey), "slots", ())))
        return comps

    def _forget(self, key: CacheKey) -> None:
        """Drop a model whose load failed: the next node loads it again, in the foreground."""
        with self._lock:
            self._components.pop(key, None)
        self.weights.remove(key)
        self._sync_next.add(key)

    def _accepts_loader(self, name: str, inst: ModelFn) -> bool:
        """Whether the ModelFn's ``load_model`` takes ``loader`` (plugins written before it may not)."""
        takes = self._takes_loader.get(name)
        if takes is None:
            params = inspect.signature(inst.load_model).parameters
            takes = "loader" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
            self._takes_loader[name] = takes
        return takes

    def host_report(self) -> tuple[list[ModelKey], dict[str, int]]:
        """Models whose bytes the box's host tier holds (loaded by any executor of the box) and the
        tier's counters, from one read of its index (empty without a tier)."""
        tier = getattr(self.loader, "host_tier", None)
        if tier is None:
            return [], {}
        tags, stats = tier.report()
        keys = []
        for tag in sorted(tags):
            try:
                keys.append(ModelKey.decode(tag))
            except ValueError:
                continue  # a tag that is not a model key (another kind of entry)
        return keys, {k: int(v) for k, v in stats.items()}

    def host_resident(self) -> list[ModelKey]:
        return self.host_report()[0]

    def host_stats(self) -> dict[str, int]:
        return self.host_report()[1]

    def resident(self) -> list[ModelKey]:
        """The models loaded with every layer on the device, in the order of their encoded keys."""
        cached = self.weights.snapshot()
        with self._lock:
            keys = list(self._components)
        full = {
            model_in(k)
            for k in keys
            if k not in self.weights.models or (k in cached and cached[k][0] == cached[k][1])
        }
        return sorted(full, key=ModelKey.encode)

    def cached(self) -> dict[ModelKey, tuple[int, int, int, int]]:
        """Per model with any layer on the device: (resident layers, layers, resident bytes, bytes)
        (under WCache: its most resident copy)."""
        return per_model(self.weights.snapshot())  # type: ignore[return-value]

    def trim(self, fn: str, model: str, resident: int) -> None:
        """Keep only the first ``resident`` layers of a loaded model (benchmarks, tests)."""
        self.weights.trim(ModelKey(fn, model), resident)


def default_dtype(inst: ModelFn, device: str) -> str | None:
    """The dtype ``inst``'s model runs at on ``device`` when T2I_EXECUTOR_DTYPES names none: the
    ModelFn's own ``device_dtypes``, else its built-in family's (bf16 or fp16 on CUDA), else None
    (as ``from_pretrained`` loads: the CPU catalog stays fp32)."""
    kind = device.partition(":")[0]
    own = type(inst).device_dtypes.get(kind)
    return own or device_dtype(family_of_fn(inst.fn_name), device)


class _Fetches:
    """The inputs one node run pulls: the leases it holds (closed when the run ends, however it
    ends), the tensors to release at their producers after a success, and the time and bytes the
    pulls took."""

    __slots__ = ("runner", "node", "leases", "reads", "seconds", "nbytes")

    def __init__(self, runner: NodeRunner, node: NodeRef) -> None:
        self.runner = runner
        self.node = node
        self.leases: list[Lease] = []
        self.reads: list[TensorMeta] = []
        self.seconds = 0.0
        self.nbytes = 0  # pulled from other executors (local inputs are zero-copy views)

    def pull(self, meta: TensorMeta) -> torch.Tensor:
        runner = self.runner
        t0 = time.perf_counter()
        try:
            lease = runner.store.open(meta)  # validates the metadata first
        except PeerBusyError as e:  # alive but at its connection cap: try again, do not restart
            raise NodeError(f"input {meta.tensor_id}: {e}", retryable=True) from e
        except TransportError as e:
            raise NodeError(f"input {meta.tensor_id}: {e}", retryable=True, unreachable=meta.executor) from e
        except (DataPlaneError, BadTensorMetaError) as e:
            raise NodeError(f"input {meta.tensor_id}: {e}", retryable=is_retryable(e)) from e
        self.leases.append(lease)
        tensor = lease.tensor
        if tensor.device != runner.device:
            tensor = tensor.to(runner.device, non_blocking=False)
        self.seconds += time.perf_counter() - t0
        if meta.executor != runner.store.executor_id:
            self.nbytes += meta.nbytes
        return tensor

    def pull_any(self, value: TensorMeta | list[TensorMeta]) -> Any:
        metas = value if isinstance(value, list) else [value]
        self.reads.extend(metas)
        tensors = [self.pull(m) for m in metas]
        return tensors if isinstance(value, list) else tensors[0]

    def wait_pending(self, name: str) -> Any:
        t0 = time.perf_counter()
        value = self.runner.callbacks.wait(self.node.callback(name), self.runner.callback_timeout_s)
        self.seconds += time.perf_counter() - t0  # waiting for the producer: not compute
        return self.pull_any(value)

    def close(self) -> None:
        """Free the pulled copies (zero-copy views of our own tensors hold nothing)."""
        for lease in self.leases:
            lease.close()
        self.leases.clear()


class NodeRunner:
    """Runs dispatched nodes for real, one at a time, in one worker thread (``run``), so the
    executor's asyncio loop stays free for heartbeats and releases."""

    cancels_cleanly = False  # execute runs in a thread: a node over its time limit cannot be stopped
    host_report_blocks = True  # the host tier's report takes a file lock

    def __init__(
        self,
        store: TensorStore,
        models: ModelCache,
        device: str = "cpu",
        callbacks: CallbackBox | None = None,
        callback_timeout_s: float = 300.0,
    ) -> None:
        self.store = store
        self.models = models
        self.device = torch.device(device)
        self.callbacks = callbacks or CallbackBox()
        self.callback_timeout_s = callback_timeout_s
        self.activations = ActivationProfile(self.device, models.weights)
        # The CUDA runtime's current device is per thread: the node thread's is ours (a device
        # transport keeps every GPU visible and names ours ``cuda:<index>``).
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="node", initializer=self._bind_device
        )

    def _bind_device(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    async def run(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome:
        # In the caller's context: the node thread's log lines carry the request id it bound.
        run = functools.partial(contextvars.copy_context().run, self.run_sync, d, blobs or {})
        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    def resident(self) -> list[ModelKey]:
        return self.models.resident()

    def cached(self) -> dict[ModelKey, tuple[int, int, int, int]]:
        """Per model with any layer on the device: (resident layers, layers, resident bytes, bytes)."""
        return self.models.cached()

    def host_report(self) -> tuple[list[ModelKey], dict[str, int]]:
        return self.models.host_report()

    def request_ended(self, request_id: str) -> None:
        """The scheduler released ``request_id`` (NoCache: nothing of it stays on the device)."""
        self.models.weights.end_request(request_id)

    def follow(self, deployment: str) -> bool:
        return self.models.weights.policy.regranulate(cache_granularity("", deployment))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_sync(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome:
        """Run ``d`` in this thread: check its inputs, load its model, then bind, execute and store.

        Raises NodeError when the node fails; what the run acquired is given back either way.
        """
        node = d.ref
        with ExitStack() as run:
            run.callback(self.callbacks.forget, node)  # deliveries it never asked for, however it ends
            fn = self.models.fn(d.fn)
            declared = fn.inputs
            missing = [n for n in declared if n not in d.inputs and n not in fn.optional]
            unknown = [n for n in d.inputs if n not in declared]
            if missing or unknown:
                raise NodeError(f"{d.fn} got inputs {sorted(d.inputs)}, declares {sorted(declared)}")
            fetches = _Fetches(self, node)
            run.callback(fetches.close)
            self.models.weights.begin_request(d.request_id)  # NoCache: another request's models go
            held = self.models.acquire(d.fn, d.model, d.workflow)  # missing layers copy in while it runs
            tiled: list[Any] = []
            try:
                try:
                    tiled = tile_if_short(self.models.weights, held.key, held.components)
                    inputs, deferred = self._bind_inputs(d, declared, blobs or {}, fetches)
                    base = self.activations.begin()
                    outs, exec_s = self._execute(fn, held.components, inputs, fetches)
                    self.activations.end(held.key, base)
                finally:
                    for module in tiled:
                        module.disable_tiling()
                    load = self.models.release(held)  # unpinned: evictable again
            except NodeError:
                raise
            except LayerLoadError as e:
                raise NodeError(f"{d.fn}: {e}", retryable=True) from e
            except torch.OutOfMemoryError as e:
                # What ran out of room needs more than the room it had: its next run leaves more
                # (and a decode that can tile, tiles).
                self.activations.out_of_memory(held.key)
                raise NodeError(f"{d.fn} ran out of memory: {e}", retryable=True) from e
            except Exception as e:
                raise NodeError(f"{d.fn}.execute raised {type(e).__name__}: {e}") from e
            exec_s -= load.stall_s  # waiting for weights is loading, not compute
            if not isinstance(outs, dict):
                raise NodeError(f"{d.fn}.execute returned {type(outs).__name__}, not a dict of outputs")
            for dfr, meta in deferred:  # callback inputs execute never asked for: done with too
                if not dfr.fetched:
                    fetches.reads.extend(meta if isinstance(meta, list) else [meta])
            stored: list[str] = []  # tensor ids put so far: discarded if the run fails after all
            run.push(functools.partial(self._discard_on_failure, stored))
            t0 = time.perf_counter()
            metas, pngs = self._store_outputs(d, node, outs, stored)
            store_s = time.perf_counter() - t0
            timing = NodeTiming(
                load_s=load.seconds,
                fetch_s=fetches.seconds,
                exec_s=max(exec_s, 0.0),
                store_s=store_s,
                load_tier=load.tier,
                load_bytes=load.disk_bytes,
                load_frac=min(1.0, max(0.0, load.frac)),
            )
            return NodeOutcome(
                outputs=metas, pngs=pngs, timing=timing, bytes_in=fetches.nbytes, reads=fetches.reads
            )

    def _bind_inputs(
        self, d: Dispatch, declared: dict[str, bool], blobs: dict[str, bytes], fetches: _Fetches
    ) -> tuple[dict[str, Any], list[tuple[Deferred, TensorMeta | list[TensorMeta]]]]:
        """The keyword arguments of ``execute``, and the callback inputs among them (not yet pulled)."""
        inputs: dict[str, Any] = {}
        deferred: list[tuple[Deferred, TensorMeta | list[TensorMeta]]] = []
        for name, inp in d.inputs.items():
            match inp:
                case ConstInput(value=value):
                    inputs[name] = value
                case LoraInput(path=path):
                    try:
                        inputs[name] = resolve_lora_path(path, self.models.root)
                    except ValueError as e:
                        raise NodeError(f"input {name}: {e}") from None
                case ImageInput(name=obj):
                    inputs[name] = decode_image(blobs.get(obj), obj)
                case PendingInput():  # producer still running: wait only when execute asks
                    inputs[name] = Deferred(name, functools.partial(fetches.wait_pending, name))
                case TensorInput(meta=meta) | TensorListInput(metas=meta):
                    if declared[name]:  # callback input: fetched when execute reaches it (paper §5.2)
                        dfr = Deferred(name, functools.partial(fetches.pull_any, meta))
                        deferred.append((dfr, meta))
                        inputs[name] = dfr
                    else:
                        inputs[name] = fetches.pull_any(meta)
        return inputs, deferred

    def _execute(
        self, fn: ModelFn, components: dict[str, Any], inputs: dict[str, Any], fetches: _Fetches
    ) -> tuple[Any, float]:
        """``fn.execute`` on ``inputs`` (dropped afterwards) and its compute seconds."""
        try:
            fetch_s_before = fetches.seconds
            self._sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                outs = fn.execute(components, **inputs)
            self._sync()
            # Callback fetches happen inside execute; count them as transfer, not compute.
            return outs, time.perf_counter() - t0 - (fetches.seconds - fetch_s_before)
        finally:
            inputs.clear()

    def _store_outputs(
        self, d: Dispatch, node: NodeRef, outs: dict[str, Any], stored: list[str]
    ) -> tuple[dict[str, TensorMeta | list[TensorMeta]], dict[str, Png]]:
        """Each output kept for its consumers in the arena (its id appended to ``stored``) and/or
        encoded as a PNG for its sink."""
        group = node.attempt_ref.encode()
        metas: dict[str, TensorMeta | list[TensorMeta]] = {}
        pngs: dict[str, Png] = {}
        for plan in d.outputs:
            value = outs.get(plan.name)
            tensors = list(value) if isinstance(value, list | tuple) else [value]
            if not all(isinstance(v, torch.Tensor) for v in tensors):
                raise NodeError(
                    f"{d.fn}.execute returned no tensor (or list of tensors) for output {plan.name!r}"
                )
            if plan.consumers > 0:
                ref = node.output(plan.name)
                try:
                    if isinstance(value, list | tuple):  # a list output: one tensor each, in order
                        metas[plan.name] = [
                            self._put(ref.at(i).encode(), v, plan.consumers, group, stored)
                            for i, v in enumerate(value)
                        ]
                    else:
                        metas[plan.name] = self._put(ref.encode(), value, plan.consumers, group, stored)
                except DataPlaneError as e:
                    raise NodeError(f"storing {plan.name}: {e}", retryable=is_retryable(e)) from e
            if plan.sink:
                pngs[plan.name] = encode_png(value)
        return metas, pngs

    def _put(
        self, tid: str, value: torch.Tensor, consumers: int, group: str, stored: list[str]
    ) -> TensorMeta:
        self.store.discard(tid)  # a retried node replaces its earlier output
        meta = self.store.put(tid, value, consumers=consumers, group=group)
        stored.append(tid)
        return meta

    def _discard_on_failure(
        self, stored: list[str], exc_type: type[BaseException] | None, exc: object, tb: object
    ) -> None:
        """An exit callback of the run: outputs of a node that failed are never read; free them."""
        if exc_type is not None:
            for tid in stored:
                self.store.discard(tid)
