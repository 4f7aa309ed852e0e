"""The data plane (paper §5): executor arenas and peer-to-peer tensor transfer.

This package's top level is torch-free: the gateway and scheduler import the metadata and
errors from here. The executor-side tensor store is ``libs.dataplane.store`` (imports torch).
"""

from __future__ import annotations

from libs.dataplane.arena import (
    Arena,
    HeapArena,
    Segment,
    ShmArena,
    segment_exists,
    segment_name,
    unlink_segment,
)
from libs.dataplane.buddy import BuddyAllocator
from libs.dataplane.errors import (
    ArenaClosedError,
    ArenaFullError,
    DataPlaneError,
    TensorNotFoundError,
    TransportError,
)
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport, make_transport
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import DTYPE_SIZES, TensorMeta, check_meta, decode_meta, encode_meta

__all__ = [
    "Arena",
    "ArenaClosedError",
    "ArenaFullError",
    "BadTensorMetaError",
    "BuddyAllocator",
    "DTYPE_SIZES",
    "DataPlaneError",
    "HeapArena",
    "Segment",
    "ShmArena",
    "ShmTransport",
    "TcpTransport",
    "TensorMeta",
    "TensorNotFoundError",
    "Transport",
    "TransportError",
    "check_meta",
    "decode_meta",
    "encode_meta",
    "make_transport",
    "segment_exists",
    "segment_name",
    "unlink_segment",
]
