"""Running one node on this executor: load the model once, pull inputs, execute, store outputs.

This is the torch side of the executor; it runs in the executor's single worker thread so the
asyncio loop stays free for heartbeats and releases. Everything a node needs arrives in its
``Dispatch``: constants, and tensor metadata that the data plane turns into tensors (a zero-copy
view when the producer was this executor, a one-sided pull into our arena otherwise, §5.2).
Inputs declared ``callback=True`` arrive as :class:`~libs.workflow.modelfn.Deferred` and are pulled
only when ``execute`` reaches the point that needs them.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from libs.common.paths import resolve_model_path
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.protocol.tensor_meta import TensorMeta, check_meta
from libs.dataplane.store import TensorStore
from libs.protocol.messages import (
    ConstInput,
    Dispatch,
    ImageInput,
    LoraInput,
    NodeTiming,
    PendingInput,
    TensorInput,
    TensorListInput,
    tensor_id,
)
from libs.workflow import catalog
from libs.workflow.modelfn import Deferred, ModelFn
from services.executor.callbacks import CallbackBox
from services.executor.outcome import NodeError, NodeOutcome, Png

log = logging.getLogger(__name__)


@dataclass
class _FetchStats:
    seconds: float = 0.0
    nbytes: int = 0  # pulled from other executors (local inputs are zero-copy views)


class ModelCache:
    """ModelFn instances and their loaded components, kept for the executor's lifetime."""

    def __init__(self, root: Path, device: str) -> None:
        self.root = root
        self.device = device
        self._fns: dict[str, ModelFn] = {}
        self._components: dict[str, dict[str, Any]] = {}
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

    def components(self, fn: str, model: str) -> tuple[dict[str, Any], float]:
        """The loaded components of ``fn`` for ``model`` and the seconds spent loading (0 if resident)."""
        key = f"{fn}|{model}"
        comps = self._components.get(key)
        if comps is not None:
            return comps, 0.0
        inst = self.fn(fn)
        path = resolve_model_path(model, self.root)
        t0 = time.perf_counter()
        try:
            comps = inst.load_model(path)
        except (OSError, ValueError) as e:
            raise NodeError(f"{fn} cannot load model {model!r} (from {path!r}): {e}") from e
        load_s = time.perf_counter() - t0
        with self._lock:
            self._components[key] = comps
        log.info("loaded %s in %.2fs", key, load_s)
        return comps, load_s

    def resident(self) -> list[str]:
        with self._lock:
            return sorted(self._components)


def decode_image(data: bytes | None, name: str) -> Any:
    """An ``image`` input: the PNG the gateway validated and stored, as an RGB ``PIL.Image``."""
    from PIL import Image

    if data is None:
        raise NodeError(f"image {name!r} is missing from the images bucket (expired?)")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # noqa: BLE001 - corrupt input: the node fails, the executor does not
        raise NodeError(f"image {name!r} cannot be decoded: {e}") from e
    return img.convert("RGB")


def encode_png(image: torch.Tensor) -> Png:
    """A uint8 [H, W, 3] (or [1, H, W, 3]) tensor -> PNG bytes."""
    from PIL import Image

    if image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] not in (1, 3, 4):
        raise NodeError(
            f"a workflow image output must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}"
        )
    arr = image.detach().cpu().contiguous().numpy()
    if arr.shape[-1] == 1:
        arr = arr[..., 0]
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return Png(buf.getvalue(), width=arr.shape[1], height=arr.shape[0])


class NodeRunner:
    """Runs dispatched nodes for real, one at a time, in one worker thread (``run``), so the
    executor's asyncio loop stays free for heartbeats and releases."""

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
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node")

    async def run(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.run_sync, d, blobs or {})

    def resident(self) -> list[str]:
        return self.models.resident()

    def _put(self, tid: str, value: torch.Tensor, consumers: int, group: str) -> TensorMeta:
        self.store.release(tid, count=1 << 30)  # a retried node replaces its earlier output
        return self.store.put(tid, value, consumers=consumers, group=group)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_sync(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome:
        blobs = blobs or {}
        fn = self.models.fn(d.fn)
        declared = fn.inputs
        missing = [n for n in declared if n not in d.inputs and n not in fn.optional]
        unknown = [n for n in d.inputs if n not in declared]
        if missing or unknown:
            raise NodeError(f"{d.fn} got inputs {sorted(d.inputs)}, declares {sorted(declared)}")
        components, load_s = self.models.components(d.fn, d.model)

        leases: list[Any] = []
        reads: list[TensorMeta] = []
        fetch = _FetchStats()

        def pull(meta: TensorMeta) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                lease = self.store.open(check_meta(meta))
            except TransportError as e:
                raise NodeError(
                    f"input {meta.tensor_id}: {e}", retryable=True, unreachable=meta.executor
                ) from e
            except DataPlaneError as e:
                raise NodeError(f"input {meta.tensor_id}: {e}", retryable=e.retryable) from e
            leases.append(lease)
            tensor = lease.tensor
            if tensor.device != self.device:
                tensor = tensor.to(self.device, non_blocking=False)
            fetch.seconds += time.perf_counter() - t0
            if meta.executor != self.store.executor_id:
                fetch.nbytes += meta.nbytes
            return tensor

        def pull_any(value: TensorMeta | list[TensorMeta]) -> Any:
            metas = value if isinstance(value, list) else [value]
            reads.extend(metas)
            tensors = [pull(m) for m in metas]
            return tensors if isinstance(value, list) else tensors[0]

        def wait_pending(name: str) -> Any:
            t0 = time.perf_counter()
            value = self.callbacks.wait(CallbackBox.key(d.key, name), self.callback_timeout_s)
            fetch.seconds += time.perf_counter() - t0  # waiting for the producer: not compute
            return pull_any(value)

        inputs: dict[str, Any] = {}
        deferred: dict[str, tuple[Deferred, Any]] = {}
        try:
            for name, inp in d.inputs.items():
                match inp:
                    case ConstInput(value=value):
                        inputs[name] = value
                    case LoraInput(path=path):
                        inputs[name] = resolve_model_path(path, self.models.root)
                    case ImageInput(name=obj):
                        inputs[name] = decode_image(blobs.get(obj), obj)
                    case PendingInput():  # producer still running: wait only when execute asks
                        inputs[name] = Deferred(name, functools.partial(wait_pending, name))
                    case TensorInput(meta=meta) | TensorListInput(metas=meta):
                        if declared[name]:  # callback input: fetched when execute reaches it (§5.2)
                            deferred[name] = (Deferred(name, functools.partial(pull_any, meta)), meta)
                            inputs[name] = deferred[name][0]
                        else:
                            inputs[name] = pull_any(meta)
            fetch_s_before = fetch.seconds
            self._sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                outs = fn.execute(components, **inputs)
            self._sync()
            # Callback fetches happen inside execute; count them as transfer, not compute.
            exec_s = time.perf_counter() - t0 - (fetch.seconds - fetch_s_before)
        except NodeError:
            raise
        except torch.OutOfMemoryError as e:
            raise NodeError(f"{d.fn} ran out of memory: {e}", retryable=True) from e
        except Exception as e:  # noqa: BLE001 - a ModelFn bug fails the node, not the executor
            raise NodeError(f"{d.fn}.execute raised {type(e).__name__}: {e}") from e
        finally:
            inputs.clear()

        if not isinstance(outs, dict):
            raise NodeError(f"{d.fn}.execute returned {type(outs).__name__}, not a dict of outputs")
        for dfr, meta in deferred.values():  # callback inputs execute never asked for: done with too
            if not dfr.fetched:
                reads.extend(meta if isinstance(meta, list) else [meta])
        t0 = time.perf_counter()
        group = f"{d.request_id}/{d.attempt}"
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
                tid = tensor_id(d.request_id, d.attempt, d.node_id, plan.name)
                try:
                    if isinstance(value, list | tuple):  # a list output: one tensor each, in order
                        metas[plan.name] = [
                            self._put(f"{tid}#{i}", v, plan.consumers, group) for i, v in enumerate(value)
                        ]
                    else:
                        metas[plan.name] = self._put(tid, value, plan.consumers, group)
                except DataPlaneError as e:
                    raise NodeError(f"storing {plan.name}: {e}", retryable=e.retryable) from e
            if plan.sink:
                pngs[plan.name] = encode_png(value)
        store_s = time.perf_counter() - t0
        for lease in leases:
            lease.close()
        leases.clear()
        self.callbacks.forget(d.key)
        timing = NodeTiming(load_s=load_s, fetch_s=fetch.seconds, exec_s=max(exec_s, 0.0), store_s=store_s)
        return NodeOutcome(outputs=metas, pngs=pngs, timing=timing, bytes_in=fetch.nbytes, reads=reads)
