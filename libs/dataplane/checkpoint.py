"""Converted checkpoints: a model component's weights as page-aligned partitions in execution order.

``from_pretrained`` parses safetensors, allocates every tensor and copies into it; a cold start pays
that at ~1 GB/s. A *converted* checkpoint is laid out for the loader (:mod:`libs.dataplane.loader`)
instead: plain partition files that ``O_DIRECT`` reads land in one flat buffer, every tensor a view of
it (no parsing, no copies), checked chunk by chunk with CRC32 as they land.

Where it lives. Beside the component it was converted from, in
``<component_dir>/.t2i-ckpt/<variant>/`` (``variant`` = ``native`` for the dtypes ``from_pretrained``
gives without ``torch_dtype``, else the dtype name, e.g. ``bfloat16``)::

    index.json                  the Index below (msgspec, JSON)
    part-000.bin, part-001.bin  partitions: the tensors' bytes, each file padded to 4 KiB

Layout. Tensors are stored in *layer* order: a layer is one element of a ``ModuleList`` of blocks
(``transformer_blocks.3``, ``down_blocks.1``, ``text_model.encoder.layers.5``) or another top-level
module (``x_embedder``, ``text_model.embeddings``); modules are walked in registration order, which in
diffusers and transformers follows the forward, so a prefix of the bytes is a prefix of the model and
the loader can report each layer ready as soon as the bytes before its end have landed (the paper,
ServerlessT2I, §5: loading overlaps the first layers' compute). Every parameter and every buffer is
stored, persistent or not (a non-persistent buffer such as CLIP's ``position_ids`` or Gemma's
``inv_freq`` is not in the state dict, yet the model computes with it). A tensor registered under
two names (T5's ``shared.weight`` and ``encoder.embed_tokens.weight``) is stored once; the second
name records ``alias_of`` so binding gives both names the same tensor and the tie survives.

Alignment. Each tensor sits at the same address modulo 4 KiB as in the model ``from_pretrained``
built at conversion (``offset % 4096`` = its ``data_ptr() % 4096`` then; host buffers start
page-aligned). That is not cosmetic: CPU kernels pick their vector loops by the address's alignment,
and diffusers' ``from_pretrained`` leaves weights as views of the safetensors mmap, 8-byte aligned;
a 1-row matmul over such a weight and over a 256-byte aligned copy of it differ in the last bit
(measured: Flux schnell's ``time_text_embed.timestep_embedder.linear_1``, batch 1). Keeping the
residue keeps the bits. (On CUDA the loader lays tensors out 512-byte aligned on the device, as
``.to("cuda")`` allocates them.)

Integrity. Each partition carries a CRC32 per ``chunk_bytes`` chunk (the loader's read unit,
recorded in the index); a chunk that does not match, or a file shorter than the index says, raises
:class:`~libs.dataplane.errors.CorruptCheckpoint`. The index records a fingerprint of the source
(names, sizes and mtimes of the weight files and the config, the model class, the requested dtype,
the library version): :func:`ensure_converted` converts again when the checkpoint is missing, stale
or corrupt, under a file lock, writing to a temporary folder renamed into place, so no process ever
reads a half-written checkpoint or wrong weights.

Conversion loads the component once through its class's real ``from_pretrained`` (optionally with a
dtype), so the stored bytes, dtypes and buffers are exactly what ``from_pretrained`` gives.

CLI::

    python -m libs.dataplane.checkpoint convert PATH [--dtype bfloat16] [--class NAME]
    python -m libs.dataplane.checkpoint verify PATH

``PATH`` is a component folder (``config.json`` + weights) or a pipeline folder (``model_index.json``:
every component with weights). torch, diffusers and transformers are imported inside functions: the
package's top level stays importable without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c
import msgspec

from libs.dataplane.errors import CorruptCheckpoint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: offsets keep the source address residues; 3: CRC32C (hardware) per chunk


def checksum(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` continuing from ``value``: the per-chunk check of the format.

    CRC32C (the ``crc32c`` package: SSE4.2/ARMv8 instructions, ~13 GB/s here, the GIL released on
    large buffers) rather than ``zlib.crc32`` (~2 GB/s), so checking every chunk of a load costs
    little next to the read itself."""
    return crc32c.crc32c(data, value)


CKPT_DIRNAME = ".t2i-ckpt"
INDEX_NAME = "index.json"
NATIVE = "native"
ADDRESS_MODULUS = 4096  # a tensor's offset keeps its source address modulo this
PAGE = 4096  # O_DIRECT: buffer address, file offset and length are multiples of this
DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_PARTITION_BYTES = 4 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
LIBRARIES = ("diffusers", "transformers")


# -- the index -------------------------------------------------------------------------------------


class SourceFile(msgspec.Struct, frozen=True):
    """One file of the source component: a weight file, a weight index or the config."""

    name: str
    size: int
    mtime_ns: int


class Source(msgspec.Struct, frozen=True):
    """What the checkpoint was converted from; a different value means it is stale."""

    files: list[SourceFile]
    model_class: str  # "library.ClassName"
    dtype: str  # NATIVE or a torch dtype name: what from_pretrained was asked for
    library_version: str
    format_version: int = FORMAT_VERSION


class TensorEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One parameter or buffer: where its bytes are and what they are."""

    name: str
    layer: str
    kind: str  # "parameter" | "buffer"
    dtype: str  # torch dtype name, e.g. "float32"
    shape: list[int]
    partition: int
    offset: int  # in its partition file; offset % Index.align = the source tensor's address % align
    nbytes: int
    requires_grad: bool = False  # parameters: as from_pretrained left them
    alias_of: str | None = None  # stored once under this (earlier) name: bind the same tensor


class LayerEntry(msgspec.Struct, frozen=True):
    """One layer and the flat byte range its tensors span (``start == end``: it holds only aliases).
    Flat offsets count across partitions: partition ``i`` starts at the sum of the earlier sizes."""

    name: str
    start: int
    end: int


class PartitionEntry(msgspec.Struct, frozen=True):
    """One partition file: its size on disk (a multiple of 4 KiB), the bytes of tensors and padding
    before the final padding, and the CRC32C of each ``chunk_bytes`` chunk (the last may be shorter)."""

    file: str
    nbytes: int
    data_bytes: int
    crc32c: list[int]


class ModelInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """How ``from_pretrained`` configured the model, so a model built from its config matches it."""

    library: str
    class_name: str
    dtype: str  # the model's dtype as loaded
    attn_implementation: str | None = None  # transformers: config._attn_implementation


class Index(msgspec.Struct, frozen=True):
    """The whole description of a converted checkpoint (``index.json``)."""

    version: int
    source: Source
    model: ModelInfo
    chunk_bytes: int
    align: int  # ADDRESS_MODULUS: the modulus of the address residues the offsets keep
    total_bytes: int  # sum of the partitions' sizes: the flat buffer a load needs
    partitions: list[PartitionEntry]
    layers: list[LayerEntry]
    tensors: list[TensorEntry]

    def partition_bases(self) -> list[int]:
        """Flat offset of each partition's first byte."""
        bases, at = [], 0
        for p in self.partitions:
            bases.append(at)
            at += p.nbytes
        return bases

    def flat_offset(self, entry: TensorEntry, bases: list[int] | None = None) -> int:
        return (bases or self.partition_bases())[entry.partition] + entry.offset


_decode_index = msgspec.json.Decoder(Index)


def read_index(ckpt_dir: str | os.PathLike[str]) -> Index:
    """The index of the checkpoint in ``ckpt_dir``; FileNotFoundError if there is none, and
    :class:`CorruptCheckpoint` if it does not parse."""
    path = Path(ckpt_dir) / INDEX_NAME
    data = path.read_bytes()
    try:
        index = _decode_index.decode(data)
    except msgspec.DecodeError as e:
        raise CorruptCheckpoint(str(ckpt_dir), INDEX_NAME, f"unreadable index: {e}") from None
    if index.version != FORMAT_VERSION:
        raise CorruptCheckpoint(
            str(ckpt_dir), INDEX_NAME, f"format version {index.version}, not {FORMAT_VERSION}"
        )
    return index


def checkpoint_id(ckpt_dir: str | os.PathLike[str], index: Index | None = None) -> str:
    """A stable id of one converted checkpoint (the host tier's key): its real path and its index's
    content (fingerprint, layout and CRCs), so a re-converted checkpoint gets a new id."""
    path = Path(ckpt_dir)
    data = (path / INDEX_NAME).read_bytes() if index is None else msgspec.json.encode(index)
    h = hashlib.sha1(os.path.realpath(path).encode())
    h.update(b"\0")
    h.update(hashlib.sha1(data).digest())
    return "ckpt-" + h.hexdigest()


# -- names -----------------------------------------------------------------------------------------


def dtype_name(dtype: Any) -> str:
    """``NATIVE`` for None, else the torch dtype's name (``torch.bfloat16`` or ``"bfloat16"``)."""
    if dtype is None or dtype == NATIVE:
        return NATIVE
    name = str(dtype).removeprefix("torch.")
    import torch

    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return name


def checkpoint_dir(component_dir: str | os.PathLike[str], dtype: Any = None) -> Path:
    """Where the converted checkpoint of ``component_dir`` (at ``dtype``) lives."""
    return Path(component_dir) / CKPT_DIRNAME / dtype_name(dtype)


def source_files(component_dir: str | os.PathLike[str]) -> list[SourceFile]:
    """The files a conversion reads: weights, weight indexes and the config (not recursive)."""
    out = []
    for entry in os.scandir(component_dir):
        name = entry.name
        if not entry.is_file() or not (
            name == "config.json" or name.endswith(WEIGHT_SUFFIXES + (".index.json",))
        ):
            continue
        st = entry.stat()
        out.append(SourceFile(name, st.st_size, st.st_mtime_ns))
    return sorted(out, key=lambda f: f.name)


def has_weights(component_dir: str | os.PathLike[str]) -> bool:
    d = Path(component_dir)
    return (d / "config.json").is_file() and any(f.name.endswith(WEIGHT_SUFFIXES) for f in source_files(d))


def _library(cls: type) -> str:
    lib = cls.__module__.split(".")[0]
    if lib not in LIBRARIES:
        # a subclass defined elsewhere: the library of the from_pretrained it inherits
        for base in cls.__mro__:
            if base.__module__.split(".")[0] in LIBRARIES:
                return base.__module__.split(".")[0]
        raise ValueError(f"{cls.__qualname__} is neither a diffusers nor a transformers model")
    return lib


def class_id(cls: type) -> str:
    return f"{_library(cls)}.{cls.__name__}"


def resolve_class(component_dir: str | os.PathLike[str]) -> type:
    """The model class of a component folder, as a pipeline's ``from_pretrained`` picks it: the
    pipeline's ``model_index.json`` entry for the folder, else the config's ``_class_name``
    (diffusers) or ``architectures[0]`` (transformers)."""
    d = Path(component_dir)
    model_index = d.parent / "model_index.json"
    if model_index.is_file():
        entry = json.loads(model_index.read_text()).get(d.name)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] in LIBRARIES:
            return getattr(importlib.import_module(entry[0]), entry[1])
    config = json.loads((d / "config.json").read_text())
    if "_class_name" in config:
        return getattr(importlib.import_module("diffusers"), config["_class_name"])
    if config.get("architectures"):
        return getattr(importlib.import_module("transformers"), config["architectures"][0])
    raise ValueError(f"{d}: config.json names no model class (_class_name or architectures); pass one")


def source_of(component_dir: str | os.PathLike[str], cls: type, dtype: Any = None) -> Source:
    lib = _library(cls)
    return Source(
        files=source_files(component_dir),
        model_class=class_id(cls),
        dtype=dtype_name(dtype),
        library_version=importlib.import_module(lib).__version__,
    )


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
    kids = [(n, m) for n, m in module._modules.items() if m is not None]
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
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):
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
        self.f = open(path, "wb")  # noqa: SIM115 - closed in finish()
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
    # Placement: each tensor at the first offset with its source address's residue (module
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
    root = component_dir / CKPT_DIRNAME
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
    with _locked(d / CKPT_DIRNAME, dtype_name(dtype)):
        return _convert_locked(d, cls, dtype, chunk_bytes, partition_bytes)


def problem(
    ckpt_dir: str | os.PathLike[str], source: Source | None = None, *, verify_crc: bool = False
) -> str | None:
    """Why the checkpoint in ``ckpt_dir`` cannot be used (None: it can): missing, another format,
    converted from another source than ``source``, a partition missing or of the wrong size, or,
    with ``verify_crc``, a chunk whose CRC differs."""
    try:
        index = read_index(ckpt_dir)
    except FileNotFoundError:
        return "not converted"
    except CorruptCheckpoint as e:
        return e.reason
    if source is not None and index.source != source:
        return "stale: the source changed"
    try:
        if verify_crc:
            verify(ckpt_dir, index)
        else:
            check_sizes(ckpt_dir, index)
    except CorruptCheckpoint as e:
        return f"partition {e.partition}: {e.reason}"
    return None


def check_sizes(ckpt_dir: str | os.PathLike[str], index: Index) -> None:
    """Raise :class:`CorruptCheckpoint` if a partition file is missing or not the size it should be."""
    for i, part in enumerate(index.partitions):
        try:
            size = os.stat(Path(ckpt_dir) / part.file).st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(str(ckpt_dir), i, f"{part.file} is missing") from None
        if size < part.nbytes:
            raise CorruptCheckpoint(
                str(ckpt_dir), i, f"truncated: {size} bytes, the index says {part.nbytes}"
            )
        if size != part.nbytes:
            raise CorruptCheckpoint(str(ckpt_dir), i, f"{size} bytes, the index says {part.nbytes}")


def verify(ckpt_dir: str | os.PathLike[str], index: Index | None = None) -> Index:
    """Read every partition and check every chunk's CRC32; raise :class:`CorruptCheckpoint` at the
    first difference (or missing/short file). Returns the index."""
    index = index or read_index(ckpt_dir)
    check_sizes(ckpt_dir, index)
    buf = bytearray(index.chunk_bytes)
    for i, part in enumerate(index.partitions):
        with open(Path(ckpt_dir) / part.file, "rb", buffering=0) as f:
            for c, want in enumerate(part.crc32c):
                n = min(index.chunk_bytes, part.nbytes - c * index.chunk_bytes)
                got = f.readinto(memoryview(buf)[:n])
                if got != n:
                    raise CorruptCheckpoint(str(ckpt_dir), i, f"truncated in chunk {c}")
                if checksum(memoryview(buf)[:n]) != want:
                    raise CorruptCheckpoint(str(ckpt_dir), i, f"chunk {c}: CRC32C differs from the index")
    return index


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
    with _locked(d / CKPT_DIRNAME, dtype_name(dtype)):
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


# -- CLI -------------------------------------------------------------------------------------------


def component_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The component folders with weights under ``path``: itself, or a pipeline's components."""
    p = Path(path)
    if (p / "model_index.json").is_file():
        index = json.loads((p / "model_index.json").read_text())
        return [p / name for name, v in index.items() if isinstance(v, list) and has_weights(p / name)]
    if has_weights(p):
        return [p]
    raise ValueError(f"{p} is neither a component folder (config.json + weights) nor a pipeline folder")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m libs.dataplane.checkpoint", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert a component or every component of a pipeline folder")
    c.add_argument("path")
    c.add_argument(
        "--dtype", default=None, help="cast to this torch dtype (default: as from_pretrained loads)"
    )
    c.add_argument("--class", dest="cls", default=None, help="model class, e.g. diffusers.AutoencoderKL")
    c.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20)
    c.add_argument("--partition-mib", type=int, default=DEFAULT_PARTITION_BYTES >> 20)
    v = sub.add_parser("verify", help="check every chunk's CRC32 of converted checkpoints")
    v.add_argument("path", help="a checkpoint folder, a component folder or a pipeline folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "convert":
        cls = None
        if args.cls:
            lib, _, name = args.cls.rpartition(".")
            cls = getattr(importlib.import_module(lib or "diffusers"), name)
        for d in component_dirs(args.path):
            out = convert(
                d, cls, args.dtype, chunk_bytes=args.chunk_mib << 20, partition_bytes=args.partition_mib << 20
            )
            index = read_index(out)
            print(
                f"{out}: {len(index.tensors)} tensors, {len(index.layers)} layers, {index.total_bytes} bytes"
            )
        return 0
    p = Path(args.path)
    ckpts = [p] if (p / INDEX_NAME).is_file() else [
        c for d in component_dirs(p) for c in sorted((d / CKPT_DIRNAME).glob("*")) if (c / INDEX_NAME).is_file()
    ]  # fmt: skip
    bad = 0
    for ck in ckpts:
        try:
            verify(ck)
            print(f"{ck}: ok")
        except CorruptCheckpoint as e:
            bad += 1
            print(f"{ck}: CORRUPT: {e}")
    if not ckpts:
        print(f"{p}: no converted checkpoint")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
