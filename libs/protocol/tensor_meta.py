"""Tensor metadata: what a producer publishes so a consumer can pull the bytes (paper §5.2).

Torch-free on purpose: the gateway and scheduler forward these messages without importing torch.
The metadata is tiny (tens of bytes) and travels in completion messages; the tensor bytes never do.
"""

from __future__ import annotations

import math

import msgspec

from libs.protocol.errors import BadTensorMetaError

#: Transports a consumer may be asked to pull over.
TRANSPORTS = frozenset({"shm", "tcp", "cuda_ipc", "nvshmem"})

#: Element size in bytes of every dtype the data plane moves, keyed by torch's name without "torch.".
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


class TensorMeta(msgspec.Struct, frozen=True):
    """Where an immutable tensor lives and how to interpret its bytes.

    A wire message: unknown fields are tolerated and new fields get defaults.
    ``address`` is transport-specific: the shared-memory segment name (``shm``), ``"host:port"``
    (``tcp``) or the PE rank (``nvshmem``). ``offset`` is relative to the producer's arena.

    ``generation`` and ``tag_slot`` identify this tensor's incarnation of the block: the producer's
    store stamps ``(generation, hash of tensor_id, offset, nbytes)`` into slot ``tag_slot`` of its
    arena's tag table and zeroes it before the block is freed; readers check it after copying and
    raise StaleTensorError on a mismatch (docs/dataplane.md). ``generation`` 0 means unchecked
    (metadata from before the check, or bytes placed in an arena by hand).

    ``strides`` is the tensor's memory layout when it is not C-contiguous (a channels-last VAE
    latent, a transposed matrix): the block holds its ``nbytes`` in memory order and the consumer's
    tensor has these strides, as the producer's had. Kernels pick their paths by layout (the CPU's
    convolutions round differently in channels-last), so a layout lost in transit changes the bits
    of what a consumer computes. Always dense: a permutation of the dims, each stride the product of
    the sizes of the dims laid out inside it (a dim of size 1 may have any stride).
    """

    tensor_id: str
    executor: str
    transport: str
    address: str
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    device: str = "cpu"
    generation: int = 0
    tag_slot: int = 0
    strides: list[int] | None = None  # element strides of a dense layout; None: C-contiguous


def expected_nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes a C-contiguous tensor of ``dtype`` and ``shape`` occupies (``dtype`` must be known)."""
    return math.prod(shape) * DTYPE_SIZES[dtype]


def _is_int(value: object) -> bool:
    # bool is an int subclass; a shape of [True] is a bug upstream, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta(meta: TensorMeta) -> TensorMeta:
    """Validate metadata that arrived off the bus; return it unchanged or raise BadTensorMetaError.

    Checks: non-empty ids and address, a known transport and dtype, non-negative offset, sizes and
    dims, ``nbytes == prod(shape) * itemsize`` (so a consumer never reads past the tensor), and a
    generation and tag slot that fit the wire's u64 and u32.
    """
    for name in ("tensor_id", "executor", "address"):
        value = getattr(meta, name)
        if not isinstance(value, str) or not value:
            raise BadTensorMetaError(name, "must be a non-empty string")
    if meta.transport not in TRANSPORTS:
        raise BadTensorMetaError("transport", f"unknown transport {meta.transport!r}")
    if meta.dtype not in DTYPE_SIZES:
        raise BadTensorMetaError("dtype", f"unknown dtype {meta.dtype!r}")
    if not _is_int(meta.offset) or meta.offset < 0:
        raise BadTensorMetaError("offset", f"must be a non-negative int, got {meta.offset!r}")
    if not _is_int(meta.nbytes) or meta.nbytes < 0:
        raise BadTensorMetaError("nbytes", f"must be a non-negative int, got {meta.nbytes!r}")
    if not isinstance(meta.shape, list | tuple):
        raise BadTensorMetaError("shape", "must be a list of ints")
    for i, dim in enumerate(meta.shape):
        if not _is_int(dim) or dim < 0:
            raise BadTensorMetaError(f"shape[{i}]", f"must be a non-negative int, got {dim!r}")
    want = expected_nbytes(meta.dtype, list(meta.shape))
    if meta.nbytes != want:
        raise BadTensorMetaError(
            "nbytes", f"{meta.nbytes} != prod({list(meta.shape)}) * {DTYPE_SIZES[meta.dtype]} = {want}"
        )
    if not isinstance(meta.device, str) or not meta.device:
        raise BadTensorMetaError("device", "must be a non-empty string")
    if not _is_int(meta.generation) or not 0 <= meta.generation < 1 << 64:
        raise BadTensorMetaError("generation", f"must be an int in [0, 2**64), got {meta.generation!r}")
    if not _is_int(meta.tag_slot) or not 0 <= meta.tag_slot < 1 << 32:
        raise BadTensorMetaError("tag_slot", f"must be an int in [0, 2**32), got {meta.tag_slot!r}")
    if meta.strides is not None:
        _check_strides(list(meta.shape), meta.strides)
    return meta


def _check_strides(shape: list[int], strides: object) -> None:
    """``strides`` must lay ``shape`` out densely (so a consumer's view never reaches past the
    block): one int per dim, and sorted by stride, the dims of size > 1 each as wide as the ones
    inside it."""
    if not isinstance(strides, list | tuple) or len(strides) != len(shape):
        raise BadTensorMetaError("strides", f"must be a list of {len(shape)} ints (one per dim)")
    for i, st in enumerate(strides):
        if not _is_int(st) or st < 0:
            raise BadTensorMetaError(f"strides[{i}]", f"must be a non-negative int, got {st!r}")
    if 0 in shape:
        return  # no element: nothing is read
    expected = 1
    for st, dim in sorted((st, dim) for st, dim in zip(strides, shape, strict=True) if dim > 1):
        if st != expected:
            raise BadTensorMetaError("strides", f"{list(strides)} is not a dense layout of {shape}")
        expected *= dim


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TensorMeta)


def encode_meta(meta: TensorMeta) -> bytes:
    """Encode metadata as msgpack (for pipes and tests; services embed TensorMeta in their messages)."""
    return _encoder.encode(meta)


def decode_meta(data: bytes) -> TensorMeta:
    """Decode and validate msgpack metadata; any problem becomes a BadTensorMetaError."""
    try:
        meta = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise BadTensorMetaError("<message>", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise BadTensorMetaError("<message>", f"undecodable: {exc}") from exc
    return check_meta(meta)
