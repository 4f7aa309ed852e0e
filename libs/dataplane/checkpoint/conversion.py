"""Writing and converting checkpoints: lay a model's parameters and buffers out in layer order at their
source address residues (:mod:`libs.dataplane.checkpoint.format`, "Layout" and "Alignment"), write the
partitions and the index, and convert a component folder, once or whenever its checkpoint is missing,
stale or corrupt (:func:`ensure_converted`).

Conversion loads the component once through its class's real ``from_pretrained`` (optionally with a
dtype), so the stored bytes, dtypes and buffers are exactly what ``from_pretrained`` gives.
:func:`ensure_converted` converts again when the checkpoint is missing, stale or corrupt, under a file
lock, writing to a temporary folder renamed into place, so no process ever reads a half-written
checkpoint or wrong weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from libs.dataplane.checkpoint.format import (
    ADDRESS_MODULUS,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PARTITION_BYTES,
    FORMAT_VERSION,
    INDEX_NAME,
    NATIVE,
    PAGE,
    Index,
    LayerEntry,
    ModelInfo,
    PartitionEntry,
    Source,
    TensorEntry,
    _library,
    checkpoint_dir,
    checkpoint_root,
    checksum,
    class_id,
    dtype_name,
    problem,
    resolve_class,
    source_of,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__package__)  # "libs.dataplane.checkpoint", the logger's name before the split


# -- layout ----------------------------------------------------------------------------------------


class Planned(msgspec.Struct):
    """One tensor of a model as the layout sees it (before placement)."""

    name: str
    tensor: Any
    kind: str
    layer: str
    alias_of: str | None = None


# Registration order follows the forward almost everywhere; where a class registers a module after
# one that runs later (diffusers' UNet and VAE decoder create ``up_blocks`` before ``mid_block``;
# transformers' decoders register ``rotary_emb`` after ``layers``), the layout moves the first name
# right before the second, so a prefix of the bytes stays a prefix of the forward.
FORWARD_ORDER_HINTS: tuple[tuple[str, str], ...] = (("mid_block", "up_blocks"), ("rotary_emb", "layers"))


def _children(module: Any) -> list[tuple[str, Any]]:
    kids = [(n, m) for n, m in module._modules.items() if m is not None]  # noqa: SLF001 - torch's registry of a module's children, in registration order
    for first, then in FORWARD_ORDER_HINTS:
        names = [n for n, _ in kids]
        if first in names and then in names and names.index(first) > names.index(then):
            item = kids.pop(names.index(first))
            kids.insert(names.index(then), item)
    return kids


def walk_modules(model: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every module of ``model`` (every path of a shared one), parents first, children in
    registration order adjusted by :data:`FORWARD_ORDER_HINTS`."""
    yield prefix, model
    for name, child in _children(model):
        yield from walk_modules(child, f"{prefix}.{name}" if prefix else name)


def layer_of(name: str, module_lists: set[str], holders: set[str], containers: set[str]) -> str:
    """The layer of tensor ``name``. From the root down, through modules that contain a
    ``ModuleList`` somewhere below (``containers``), to the first module that holds one directly
    (``holders``): there each element of a ``ModuleList`` is a layer (``down_blocks.1``) and every
    other child is one (``mid_block``, ``conv_in``). A child with no ``ModuleList`` below it is a
    layer wherever it is met (``x_embedder``), and a tensor held directly by a module passed
    through is its own (``scale_shift_table``)."""
    parts = name.split(".")
    current = ""
    for i in range(len(parts) - 1):
        child = ".".join(parts[: i + 1])
        if current in holders or child not in containers:
            if child in module_lists and i + 2 < len(parts):
                return f"{child}.{parts[i + 1]}"
            return child
        current = child
    return name


def plan_model(model: torch.nn.Module) -> list[Planned]:
    """Every parameter and buffer of ``model`` (persistent or not, every name of a shared tensor) in
    layout order: grouped by layer, layers and tensors in module order (:func:`walk_modules`); a
    tensor met again under another name becomes an alias of its first name."""
    import torch

    modules = list(walk_modules(model))
    module_lists = {path for path, mod in modules if isinstance(mod, torch.nn.ModuleList)}
    holders, containers = set(), set()
    for path in module_lists:
        parts = path.split(".")
        holders.add(".".join(parts[:-1]))
        containers.update(".".join(parts[:i]) for i in range(len(parts)))
    by_layer: dict[str, list[Planned]] = {}
    for path, mod in modules:
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API
            for attr, t in table.items():
                if t is None:
                    continue
                name = f"{path}.{attr}" if path else attr
                layer = layer_of(name, module_lists, holders, containers)
                by_layer.setdefault(layer, []).append(Planned(name, t, kind, layer))
    planned: list[Planned] = []
    first: dict[int, str] = {}
    for entries in by_layer.values():
        for p in entries:
            owner = first.setdefault(id(p.tensor), p.name)
            if owner != p.name:
                p.alias_of = owner
            planned.append(p)
    return planned


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _residue(t: Any) -> int:
    """Where ``t``'s bytes start within a page (rounded up to its element size)."""
    if t.numel() == 0:
        return 0
    return _align(t.data_ptr() % ADDRESS_MODULUS, t.element_size()) % ADDRESS_MODULUS


def _with_residue(at: int, residue: int) -> int:
    """The first offset >= ``at`` that is ``residue`` modulo ADDRESS_MODULUS."""
    offset = at - at % ADDRESS_MODULUS + residue
    return offset if offset >= at else offset + ADDRESS_MODULUS


class _PartitionWriter:
    """Writes one partition file and the CRC32 of each chunk of it as the bytes go by."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        self.path = path
        self.chunk = chunk_bytes
        self.f = open(path, "wb")
        self.pos = 0
        self.crcs: list[int] = []
        self._crc = 0

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            room = self.chunk - self.pos % self.chunk
            piece = data[:room]
            self.f.write(piece)
            self._crc = checksum(piece, self._crc)
            self.pos += len(piece)
            data = data[len(piece) :]
            if self.pos % self.chunk == 0:
                self.crcs.append(self._crc)
                self._crc = 0

    def pad_to(self, pos: int) -> None:
        zeros = bytes(min(pos - self.pos, PAGE * 16))
        while self.pos < pos:
            self.write(memoryview(zeros)[: pos - self.pos])

    def finish(self) -> tuple[int, int, list[int]]:
        data_bytes = self.pos
        self.pad_to(_align(self.pos, PAGE))
        if self.pos % self.chunk:
            self.crcs.append(self._crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.pos, data_bytes, self.crcs


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _model_info(model: torch.nn.Module, cls: type) -> ModelInfo:
    import torch

    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = dtypes[0] if dtypes else torch.float32
    attn = None
    config = getattr(model, "config", None)
    if _library(cls) == "transformers" and config is not None:
        attn = getattr(config, "_attn_implementation", None)
        if isinstance(getattr(config, "dtype", None), torch.dtype):
            dtype = config.dtype  # what from_pretrained resolved ("auto": the config's, else the weights')
    return ModelInfo(_library(cls), cls.__name__, str(dtype).removeprefix("torch."), attn)


def write_checkpoint(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    source: Source,
    info: ModelInfo,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
) -> Index:
    """Write ``model``'s parameters and buffers into ``out_dir`` (which must exist) as partitions +
    ``index.json`` (written last), and return the index."""
    if chunk_bytes <= 0 or chunk_bytes % PAGE:
        raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE}, got {chunk_bytes}")
    out = Path(out_dir)
    planned = plan_model(model)
    # Placement: each tensor at the first offset with its source address's residue (format
    # docstring, "Alignment"); a new partition when the next tensor would not fit.
    placed: dict[str, tuple[int, int]] = {}
    parts: list[list[Planned]] = [[]]
    at = 0
    for p in planned:
        if p.alias_of is not None:
            continue
        nbytes = p.tensor.numel() * p.tensor.element_size()
        offset = _with_residue(at, _residue(p.tensor))
        if parts[-1] and offset + nbytes > partition_bytes:
            parts.append([])
            offset = _residue(p.tensor)
        parts[-1].append(p)
        placed[p.name] = (len(parts) - 1, offset)
        at = offset + nbytes
    if not parts[-1]:
        parts.pop()
    partitions: list[PartitionEntry] = []
    for i, members in enumerate(parts):
        file = f"part-{i:03d}.bin"
        w = _PartitionWriter(out / file, chunk_bytes)
        try:
            for p in members:
                w.pad_to(placed[p.name][1])
                if p.tensor.numel():
                    w.write(_tensor_bytes(p.tensor))
            nbytes, data_bytes, crcs = w.finish()
        except BaseException:
            w.f.close()
            raise
        partitions.append(PartitionEntry(file, nbytes, data_bytes, crcs))
    bases, base = [], 0
    for part in partitions:
        bases.append(base)
        base += part.nbytes
    entries: list[TensorEntry] = []
    stored: dict[str, TensorEntry] = {}
    layers: dict[str, list[int]] = {}
    last_end = 0
    for p in planned:
        t = p.tensor
        grad = bool(p.kind == "parameter" and t.requires_grad)
        common = dict(
            name=p.name, layer=p.layer, kind=p.kind, dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape), requires_grad=grad,
        )  # fmt: skip
        if p.alias_of is None:
            part, offset = placed[p.name]
            e = TensorEntry(**common, partition=part, offset=offset, nbytes=t.numel() * t.element_size())
            stored[p.name] = e
            lo = bases[part] + offset
            span = layers.setdefault(p.layer, [lo, lo])
            span[1] = max(span[1], lo + e.nbytes)
            last_end = span[1]
        else:
            target = stored[p.alias_of]
            e = TensorEntry(
                **common, partition=target.partition, offset=target.offset, nbytes=target.nbytes,
                alias_of=p.alias_of,
            )  # fmt: skip
            layers.setdefault(p.layer, [last_end, last_end])
        entries.append(e)
    index = Index(
        version=FORMAT_VERSION,
        source=source,
        model=info,
        chunk_bytes=chunk_bytes,
        align=ADDRESS_MODULUS,
        total_bytes=base,
        partitions=partitions,
        layers=[LayerEntry(name, lo, hi) for name, (lo, hi) in layers.items()],
        tensors=entries,
    )
    tmp = out / (INDEX_NAME + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(index))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, out / INDEX_NAME)
    return index


# -- conversion ------------------------------------------------------------------------------------


def load_source_model(component_dir: str | os.PathLike[str], cls: type, dtype: Any = None) -> Any:
    """The component as its class's real ``from_pretrained`` loads it (at ``dtype`` if given)."""
    import torch

    kwargs: dict[str, Any] = {}
    name = dtype_name(dtype)
    if name != NATIVE:
        key = "dtype" if _library(cls) == "transformers" else "torch_dtype"
        kwargs[key] = getattr(torch, name)
    return cls.from_pretrained(str(component_dir), **kwargs)


@contextlib.contextmanager
def _locked(root: Path, variant: str) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{variant}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _convert_locked(
    component_dir: Path, cls: type, dtype: Any, chunk_bytes: int, partition_bytes: int
) -> Path:
    variant = dtype_name(dtype)
    root = checkpoint_root(component_dir)
    final = root / variant
    for stale in root.glob(f".tmp-{variant}-*"):  # left by a conversion that died (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    source = source_of(component_dir, cls, dtype)
    t0 = time.perf_counter()
    model = load_source_model(component_dir, cls, dtype)
    tmp = root / f".tmp-{variant}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        index = write_checkpoint(
            model,
            tmp,
            source,
            _model_info(model, cls),
            chunk_bytes=chunk_bytes,
            partition_bytes=partition_bytes,
        )
        old = None
        if final.exists():
            old = root / f".old-{variant}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "converted %s (%s, %s): %d tensors, %.1f MiB in %.2fs",
        component_dir, class_id(cls), variant, len(index.tensors), index.total_bytes / 2**20,
        time.perf_counter() - t0,
    )  # fmt: skip
    return final


def convert(
    component_dir: str | os.PathLike[str],
    cls: type | None = None,
    dtype: Any = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
) -> Path:
    """Convert ``component_dir`` (again, unconditionally) and return the checkpoint's folder."""
    d = Path(component_dir)
    cls = cls or resolve_class(d)
    with _locked(checkpoint_root(d), dtype_name(dtype)):
        return _convert_locked(d, cls, dtype, chunk_bytes, partition_bytes)


def ensure_converted(
    component_dir: str | os.PathLike[str],
    cls: type | None = None,
    dtype: Any = None,
    *,
    verify_crc: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
) -> Path:
    """The folder of an up-to-date converted checkpoint of ``component_dir``: the existing one if it
    fits the source (sizes checked; every CRC too with ``verify_crc``), else converted now (a
    warning says why). Safe to call from several processes at once: one converts, the others wait
    for it and then use its result."""
    d = Path(component_dir)
    cls = cls or resolve_class(d)
    final = checkpoint_dir(d, dtype)
    source = source_of(d, cls, dtype)
    if problem(final, source, verify_crc=verify_crc) is None:
        return final
    with _locked(checkpoint_root(d), dtype_name(dtype)):
        why = problem(
            final, source_of(d, cls, dtype), verify_crc=verify_crc
        )  # another process may have fixed it
        if why is None:
            return final
        if why == "not converted":
            log.info("converting %s (%s, %s) for fast loading", d, class_id(cls), dtype_name(dtype))
        else:
            log.warning("re-converting %s (%s, %s): %s", d, class_id(cls), dtype_name(dtype), why)
        return _convert_locked(d, cls, dtype, chunk_bytes, partition_bytes)
