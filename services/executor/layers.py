"""The Layer Lookup Table (paper ServerlessT2I, arXiv 2607.26566, §5.3, Fig. 9-left): for one model
key, every layer of its components, the tensors of each and the module attributes they are bound
to, where their bytes live, and the forward hooks that make each layer wait for its own weights.

:class:`VirtualModel` only binds and unbinds; which layers are resident, and where, is the
:class:`~services.executor.weights.WeightCache`'s business (docs/memory.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.dataplane.checkpoint import Index
from libs.dataplane.loader.layout import DEVICE_ALIGN
from libs.models.common import loaded_checkpoint

PAGE = 4096


class LayerLoadError(RuntimeError):
    """A layer's weights could not be loaded (the node fails; the executor goes on)."""


@dataclass
class _Tensor:
    """One parameter or buffer of a layer: where it goes in the layer's buffer and whom it binds."""

    owner: torch.nn.Module
    attr: str
    parameter: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    flat: int  # offset in the checkpoint's flat host buffer
    nbytes: int
    at: int = 0  # offset in the layer's buffer
    aliases: list[tuple[torch.nn.Module, str]] = field(default_factory=list)  # tied names


class LayerSlot:
    """One row of the Layer Lookup Table."""

    def __init__(self, component: int, name: str, module: torch.nn.Module | None) -> None:
        self.component = component
        self.name = name
        self.module = module  # the layer's module (None: a tensor held directly by a parent)
        self.tensors: list[_Tensor] = []
        self.start = 0  # flat range of the layer in its checkpoint
        self.end = 0
        self.base = 0  # flat offset the layer's buffer starts at (page-aligned on the CPU)
        self.nbytes = 0  # size of the layer's buffer
        self.where = "none"
        self.storage: torch.Tensor | None = None
        self.arena_offset: int | None = None
        self.ready = threading.Event()
        self.filled = False
        self.event: Any = None  # CUDA event recorded after the copy (None on the CPU)


class _Component:
    def __init__(self, module: torch.nn.Module, path: Path, index: Index, first: int) -> None:
        self.module = module
        self.path = path  # the converted checkpoint
        self.index = index
        self.first = first  # its first slot in the model's table


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fill = math.nan if dtype.is_floating_point else 0
    return torch.full((), fill, dtype=dtype, device=device).expand(shape)


def _state_only(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds buffers and no parameters (below it included)."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is not None


class WrongDeviceError(LayerLoadError):
    """A layer's bytes are on another device than its model (a bug of placement, never bound)."""


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when the current device is 0 (the lease's ``cuda``
    is the only visible GPU); otherwise type and index must match."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


class VirtualModel:
    """The Layer Lookup Table of one model key: the layers of all its components, in order."""

    def __init__(self, key: Hashable, components: dict[str, Any], device: torch.device) -> None:
        self.key = key
        self.device = device
        self.components: list[_Component] = []
        self.slots: list[LayerSlot] = []
        self.sources: dict[int, Any] = {}  # component -> LoadedCheckpoint to copy from (this load)
        self.loader: Any = None  # reloads evicted layers (tagged with the model's key)
        self.stall_s = 0.0  # waiting in pre-hooks for weights, this run
        self.profiling = False
        self.comp_s: list[float] = []
        self._started: dict[int, float] = {}
        self._hooks: list[Any] = []
        # Layers whose module holds buffers only (a batch norm's running statistics, a rotary
        # embedding's frequencies): state the pipeline's code may read outside any forward, where
        # no hook waits, so they are loaded before the model runs (WeightCache.begin).
        self.direct: list[int] = []
        seen: set[int] = set()
        for value in components.values():
            for item in value if isinstance(value, list | tuple) else (value,):
                loaded = loaded_checkpoint(item) if isinstance(item, torch.nn.Module) else None
                if loaded is None or id(item) in seen:
                    continue
                seen.add(id(item))
                self._add_component(item, loaded)
        self._add_shared_names()
        self.comp_s = [0.0] * len(self.slots)
        if self.device.type == "cuda":
            # Until its first copy lands a layer points at device placeholders, not at the host
            # staging buffer it was loaded into: ``model.device`` must name the device the ModelFn
            # runs on (a ModelFn moves its inputs there before the forward's hooks bind the layers).
            for i in range(len(self.slots)):
                self.unbind(i)

    # -- the table ---------------------------------------------------------------------------------
    def _add_component(self, module: torch.nn.Module, loaded: Any) -> None:
        index: Index = loaded.index
        c = len(self.components)
        comp = _Component(module, loaded.path, index, len(self.slots))
        self.components.append(comp)
        self.sources[c] = loaded
        by_layer: dict[str, LayerSlot] = {}
        for layer in index.layers:
            try:
                sub = module.get_submodule(layer.name)
            except AttributeError:
                sub = None  # a tensor held directly by a module passed through (scale_shift_table)
            slot = LayerSlot(c, layer.name, sub)
            slot.start, slot.end = layer.start, layer.end
            by_layer[layer.name] = slot
            self.slots.append(slot)
        bases = index.partition_bases()
        named: dict[str, _Tensor] = {}
        for e in index.tensors:
            path, _, attr = e.name.rpartition(".")
            owner = module.get_submodule(path)
            if e.alias_of is not None:
                named[e.alias_of].aliases.append((owner, attr))
                continue
            t = _Tensor(
                owner, attr, e.kind == "parameter", getattr(torch, e.dtype), tuple(e.shape),
                bases[e.partition] + e.offset, e.nbytes,
            )  # fmt: skip
            named[e.name] = t
            by_layer[e.layer].tensors.append(t)
        cuda = self.device.type == "cuda"
        for slot in by_layer.values():
            if not slot.tensors:
                continue
            if cuda:  # as .to("cuda") would allocate them
                at = 0
                for t in slot.tensors:
                    at = -(-at // DEVICE_ALIGN) * DEVICE_ALIGN
                    t.at = at
                    at += t.nbytes
                slot.nbytes = -(-at // DEVICE_ALIGN) * DEVICE_ALIGN
            else:  # the same address residues mod 4 KiB as the host buffer: the same bits
                slot.base = slot.start // PAGE * PAGE
                for t in slot.tensors:
                    t.at = t.flat - slot.base
                slot.nbytes = -(-(slot.end - slot.base) // PAGE) * PAGE
        for i, slot in enumerate(self.slots[comp.first :], start=comp.first):
            if slot.tensors and slot.module is not None and _state_only(slot.module):
                self.direct.append(i)
        self._install_hooks(comp, [s for s in self.slots[comp.first :]])

    def _add_shared_names(self) -> None:
        """Every other module attribute that holds one of the table's tensors becomes an alias of it,
        so binding and eviction rebind it too. A model may be handed another component's tensor
        (``ZImageControlNetModel.from_transformer`` sets the transformer's pad tokens on the
        ControlNet): left alone, that name would keep the first load's whole host buffer mapped.
        Such a tensor held directly by a parent (no layer module whose hook waits for it) is loaded
        before the model runs, as the other module may read it before any of its owner's hooks."""
        by_value: dict[int, tuple[int, _Tensor]] = {}
        for i, slot in enumerate(self.slots):
            for t in slot.tensors:
                table = t.owner._parameters if t.parameter else t.owner._buffers  # noqa: SLF001 - torch's registry of a module's tensors
                value = table.get(t.attr)
                if value is not None:
                    by_value[id(value)] = (i, t)
        if not by_value:
            return
        visited: set[int] = set()
        for comp in self.components:
            for module in comp.module.modules():
                if id(module) in visited:
                    continue
                visited.add(id(module))
                for parameter, table in ((True, module._parameters), (False, module._buffers)):  # noqa: SLF001 - torch's registry of a module's tensors
                    for attr, value in table.items():
                        found = by_value.get(id(value)) if value is not None else None
                        if found is None or found[1].parameter != parameter:
                            continue
                        i, t = found
                        names = [(t.owner, t.attr), *t.aliases]
                        if any(owner is module and name == attr for owner, name in names):
                            continue
                        t.aliases.append((module, attr))
                        if self.slots[i].module is None and i not in self.direct:
                            self.direct.append(i)
        self.direct.sort()

    def sizes(self) -> list[int]:
        return [s.nbytes for s in self.slots]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    # -- hooks -----------------------------------------------------------------------------------
    def _install_hooks(self, comp: _Component, slots: list[LayerSlot]) -> None:
        loose = [s for s in slots if s.module is None and s.tensors]  # waited for before any layer
        first_module = True
        for i, slot in enumerate(slots, start=comp.first):
            if slot.module is None:
                continue
            waits = [*loose, slot] if first_module else [slot]
            first_module = False
            self._hooks.append(slot.module.register_forward_pre_hook(self._pre_hook(i, waits)))
            self._hooks.append(slot.module.register_forward_hook(self._post_hook(i)))
        if loose:
            self._hooks.append(comp.module.register_forward_pre_hook(self._pre_hook(-1, loose)))

    def _pre_hook(self, i: int, waits: list[LayerSlot]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            for slot in waits:
                if not slot.ready.is_set():
                    t0 = time.perf_counter()
                    slot.ready.wait()
                    self.stall_s += time.perf_counter() - t0
                if not slot.filled and slot.tensors:
                    raise LayerLoadError(f"layer {slot.name} of {self.key} was not loaded")
                if slot.event is not None:
                    torch.cuda.current_stream(self.device).wait_event(slot.event)
            if self.profiling and i >= 0:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self._started[i] = time.perf_counter()

        return hook

    def _post_hook(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.profiling and i in self._started:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.comp_s[i] += time.perf_counter() - self._started.pop(i)

        return hook

    # -- memory ----------------------------------------------------------------------------------
    def bind(self, i: int, storage: torch.Tensor) -> None:
        """Point layer ``i``'s parameters and buffers at their bytes in ``storage`` (ties too).
        Refuses (:class:`WrongDeviceError`) storage on another device than the model's: a CUDA
        module bound to host memory would fail in its forward, or silently run elsewhere."""
        if not same_device(storage.device, self.device):
            raise WrongDeviceError(
                f"layer {self.slots[i].name} of {self.key}: its bytes are on {storage.device}, "
                f"the model runs on {self.device}; refusing to bind them"
            )
        for t in self.slots[i].tensors:
            view = storage[t.at : t.at + t.nbytes].view(t.dtype).view(t.shape)
            table = t.owner._parameters if t.parameter else t.owner._buffers  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API
            old = table[t.attr]
            value: torch.Tensor = view
            if t.parameter:
                value = torch.nn.Parameter(view, requires_grad=bool(old is not None and old.requires_grad))
            table[t.attr] = value
            for owner, attr in t.aliases:
                (owner._parameters if t.parameter else owner._buffers)[attr] = value  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API

    def unbind(self, i: int) -> None:
        """Layer ``i``'s tensors point at placeholders: its bytes can be freed."""
        for t in self.slots[i].tensors:
            table = t.owner._parameters if t.parameter else t.owner._buffers  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API
            old = table[t.attr]
            value = _placeholder(t.shape, t.dtype, self.device)
            if t.parameter:
                value = torch.nn.Parameter(value, requires_grad=bool(old is not None and old.requires_grad))
            table[t.attr] = value
            for owner, attr in t.aliases:
                (owner._parameters if t.parameter else owner._buffers)[attr] = value  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for loaded in self.sources.values():
            drop_source(loaded)
        self.sources.clear()


def drop_source(loaded: Any) -> None:
    """Let go of a load whose bytes were copied out: its lease, its views, its buffer."""
    loaded.close()
    loaded.tensors = {}  # the views were the last references to its buffer
    loaded.host_block = None
