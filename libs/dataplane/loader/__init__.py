"""The fast model-loading path: a converted checkpoint (:mod:`libs.dataplane.checkpoint`) from disk
(or the shared host tier) into tensors on the executor's device, layer by layer.

Two stages, each its own thread pool, so disk reads, checks and device copies overlap:

* **disk -> host.** ``disk_threads`` workers read chunk-sized ranges of the partitions with
  ``os.preadv`` (which releases the GIL) through ``O_DIRECT`` file descriptors straight into a
  page-aligned buffer, no page cache in between; a filesystem that refuses ``O_DIRECT`` (``EINVAL``
  at open or read: tmpfs before Linux 6.6, some network filesystems) is read buffered. Every chunk's CRC32C is checked as it lands (``checkpoint.checksum`` releases
  the GIL too); a mismatch or a short read fails the load with
  :class:`~libs.dataplane.errors.CorruptCheckpoint`, never hands out the bytes.
* **host -> device.** ``device_threads`` workers take landed chunks. On the CPU the host buffer *is*
  the device memory (every tensor is a view of it: zero copies) and this stage only marks progress.
  On a CUDA device it copies each chunk's pieces of tensors into one flat device buffer (tensors
  512-byte aligned there, :func:`device_layout`) on a side stream, from a small fixed pool of
  page-aligned staging chunks pinned with ``cudaHostRegister`` (or, with a host tier, from the
  tier's buffer, pinned for the copies), and waits for the copy before it counts the chunk.

Layers. The checkpoint stores tensors in execution order, so "layer ``L`` is ready" means "every
chunk before ``L``'s end has landed": ``layer_ready[L]`` (a ``threading.Event``) is set in layer
order as the prefix grows, and a forward may start on the first blocks while the rest still loads
(the paper, ServerlessT2I, §5). On CUDA, ``cuda_events[L]`` is also recorded on the copy stream.
``layer_seconds[L]`` is when ``L``'s event was set, from the load's start (a per-layer profile).
``load(..., first_layer=k)`` loads only ``layers[k:]`` (layer-prefix caching, §5.1): only the chunks
from the one holding layer ``k``'s start on (and any holding a tensor of the suffix tied to an
earlier layer) are read and copied; the earlier layers' events are set at once and their bytes are
unspecified. A host-tier hit or fill stays whole; ``use_host_tier=False`` bypasses the tier.

Host tier. With a ``host_tier`` (:class:`libs.dataplane.hosttier.HostTier`) the flat host buffer
is a block of the box-wide shared tier: ``host_tier.get_or_fill(key, nbytes, fill, tags)`` returns a
block whose ``buf`` holds the bytes; ``fill(buf)`` (the disk -> host stage above, into ``buf``) runs
only on a miss, at most once per box, and keeps no view of ``buf`` once it returns. A hit costs no
disk read at all (``source == "host"``). The key is :func:`~libs.dataplane.checkpoint.checkpoint_id`
(the checkpoint's real path and index content), the tags the loader's, the call's and
``ckpt:<component folder>``. On the CPU the tensors view the block (``torch.frombuffer``: the mapping
lives as long as they do); on CUDA the block only feeds the device copies. The block's lease is held
until the :class:`LoadedCheckpoint` is closed, which happens when the model is dropped.

torch is imported inside functions: ``libs.dataplane`` stays importable without it.

The package, one concept per module: :mod:`~libs.dataplane.loader.core` (the :class:`Loader`),
:mod:`~libs.dataplane.loader.loaded` (:class:`LoadedCheckpoint`),
:mod:`~libs.dataplane.loader.readjob` (the two-stage chunk pipeline),
:mod:`~libs.dataplane.loader.layout` (chunks, the device layout, views) and
:mod:`~libs.dataplane.loader.staging` (pinning and the staging pool).
"""

from __future__ import annotations

from libs.dataplane.loader.core import Loader, default_loader
from libs.dataplane.loader.layout import DEVICE_ALIGN, device_layout, views
from libs.dataplane.loader.layout import _segments as _segments  # tests check the pieces
from libs.dataplane.loader.loaded import LoadedCheckpoint
from libs.dataplane.loader.staging import buffer_address

__all__ = [
    "DEVICE_ALIGN",
    "LoadedCheckpoint",
    "Loader",
    "buffer_address",
    "default_loader",
    "device_layout",
    "views",
]
