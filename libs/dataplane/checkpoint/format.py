"""The converted-checkpoint format: where a checkpoint lives, its index (``index.json``), and reading
and verifying it.

Where it lives. Beside the component it was converted from, in
``<component_dir>/.t2i-ckpt/<variant>/`` (``variant`` = ``native`` for the dtypes ``from_pretrained``
gives without ``torch_dtype``, else the dtype name, e.g. ``bfloat16``). A component that must not be
written to, one of a Hugging Face cache snapshot (``.../models--org--name/snapshots/<rev>/...``: the
cache is the hub client's, shared and content-addressed) or a folder this process cannot write,
converts into the checkpoint cache instead (``T2I_CHECKPOINT_CACHE``; default
``~/.cache/serverless-t2i/checkpoints``), under ``<models--org--name>/<rev>/<component>/`` or
``local/<hash of the folder's path>/<name>/`` (:func:`checkpoint_root`)::

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
(The walk and the placement are in :mod:`libs.dataplane.checkpoint.conversion`.)

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
the library version): a different fingerprint means the checkpoint is stale (:func:`problem`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import crc32c
import msgspec

from libs.dataplane.errors import CorruptCheckpoint

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


CACHE_ENV = "T2I_CHECKPOINT_CACHE"


def checkpoint_cache() -> Path:
    """The folder of checkpoints converted from folders that are not written to (``T2I_CHECKPOINT_CACHE``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "serverless-t2i" / "checkpoints")


def hub_snapshot(path: str | os.PathLike[str]) -> tuple[str, str, str] | None:
    """``(models--org--name, revision, rest)`` for a path inside a Hugging Face cache snapshot
    (``<cache>/models--org--name/snapshots/<revision>/<rest>``), else None."""
    parts = Path(os.path.abspath(path)).parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i], parts[i + 2], "/".join(parts[i + 3 :])
    return None


def checkpoint_root(component_dir: str | os.PathLike[str]) -> Path:
    """The folder holding ``component_dir``'s converted checkpoints (one per variant): its own
    ``.t2i-ckpt``, or for a Hub snapshot or a folder this process cannot write, a folder of the
    checkpoint cache named after it (module docstring, "Where it lives")."""
    d = Path(os.path.abspath(component_dir))
    hub = hub_snapshot(d)
    if hub is None:
        if os.access(d, os.W_OK):
            return d / CKPT_DIRNAME
        digest = hashlib.sha256(str(d).encode()).hexdigest()[:16]
        return checkpoint_cache() / "local" / digest / d.name / CKPT_DIRNAME
    repo, revision, rest = hub
    return checkpoint_cache() / repo / revision / rest / CKPT_DIRNAME


def checkpoint_dir(component_dir: str | os.PathLike[str], dtype: Any = None) -> Path:
    """Where the converted checkpoint of ``component_dir`` (at ``dtype``) lives."""
    return checkpoint_root(component_dir) / dtype_name(dtype)


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


# -- reading and verifying -------------------------------------------------------------------------


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
