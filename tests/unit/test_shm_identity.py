"""A reader's cached mapping of a peer's segment is checked before every read, without looking the
name up again: the segment must still be linked (one fstat of the descriptor kept with the mapping)
and still hold the incarnation it held when mapped. A peer restarted under the same name, retired,
or removed is therefore never read through a stale mapping (libs/dataplane/transport/shm.py)."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from libs.dataplane.arena import Segment, segment_name, unlink_segment
from libs.dataplane.errors import StaleTensorError, TransportError
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import ShmTransport
from libs.dataplane.transport.shm import DESCRIPTOR, DESCRIPTOR_MAGIC, HEADER, _layout, retire_segment
from libs.dataplane.transport.tags import TAG
from libs.protocol.tensor_meta import TensorMeta

KIB = 1024
REPO = Path(__file__).resolve().parents[2]


def _meta(address: str, nbytes: int = 4) -> TensorMeta:
    return TensorMeta("r1/x", "producer", "shm", address, 0, nbytes, "uint8", [nbytes])


def _incarnation(transport: ShmTransport) -> int:
    shm = transport._shm
    assert shm is not None
    return HEADER.unpack_from(shm.buf, shm.size - DESCRIPTOR.size - HEADER.size)[0]


def test_every_segment_gets_a_fresh_nonzero_incarnation_that_readers_record(namespace: str) -> None:
    with (
        ShmTransport(namespace, "producer", 64 * KIB) as peer,
        ShmTransport(namespace, "other", 64 * KIB) as other,
        ShmTransport(namespace, "consumer", 64 * KIB) as ours,
    ):
        assert peer.incarnation != 0 and peer.incarnation != other.incarnation
        assert _incarnation(peer) == peer.incarnation
        ours.read(_meta(peer.address), memoryview(bytearray(4)))
        (mapped,) = ours._peers.values()
        assert mapped.incarnation == peer.incarnation and mapped.current()
        assert mapped.seg.fd >= 0  # the descriptor stays open: one fstat per check


def test_a_peer_restarted_under_the_same_name_is_detected_and_its_old_tensors_are_stale(
    namespace: str,
) -> None:
    # The predecessor never closes (a crash): its successor retires its segment, then replaces it.
    first = ShmTransport(namespace, "producer", 64 * KIB)
    old = TensorStore("producer", first).put(
        "r1/a", torch.full((64,), 1, dtype=torch.uint8), consumers=1, group="r1"
    )
    with ShmTransport(namespace, "consumer", 64 * KIB) as ours:
        consumer = TensorStore("consumer", ours)
        with consumer.open(old) as lease:  # maps and caches the predecessor's segment
            assert torch.equal(lease.tensor, torch.full((64,), 1, dtype=torch.uint8))
        cached = ours._peers[first.address]
        second = ShmTransport(namespace, "producer", 64 * KIB)
        try:
            assert _incarnation(first) == 0, "the successor retires its predecessor's segment"
            assert not cached.current()
            new = TensorStore("producer", second).put(
                "r1/a", torch.full((64,), 2, dtype=torch.uint8), consumers=1, group="r1"
            )
            # The old metadata now names a block of the successor: stale, never the old bytes
            # through the old mapping, nor the new bytes.
            with pytest.raises(StaleTensorError, match="r1/a"):
                consumer.open(old)
            with consumer.open(new) as lease:
                assert torch.equal(lease.tensor, torch.full((64,), 2, dtype=torch.uint8))
            assert ours._peers[second.address] is not cached
            assert consumer.stats()["used"] == 0
        finally:
            second.close()
            first.close()


def test_a_cached_mapping_of_a_retired_segment_is_refused_even_while_its_name_exists(
    namespace: str,
) -> None:
    with (
        ShmTransport(namespace, "producer", 64 * KIB) as peer,
        ShmTransport(namespace, "consumer", 64 * KIB) as ours,
    ):
        peer.arena.buf[:4] = b"old!"
        dst = memoryview(bytearray(4))
        ours.read(_meta(peer.address), dst)
        assert bytes(dst) == b"old!"
        peer.arena.buf[:4] = b"new!"
        assert retire_segment(peer.address)  # as a successor does, before it unlinks the name
        with pytest.raises(TransportError, match="retired") as caught:
            ours.read(_meta(peer.address), dst)
        assert caught.value.retryable
        assert bytes(dst) == b"old!", "nothing was read through the retired mapping"
        assert peer.address not in ours.peers


def test_a_cached_mapping_of_a_segment_removed_without_retiring_is_refused(namespace: str) -> None:
    # A crashed producer's segment removed by the resource tracker: nobody retired it, but it is
    # unlinked, and the fstat of the kept descriptor says so.
    with ShmTransport(namespace, "consumer", 64 * KIB) as ours:
        peer = ShmTransport(namespace, "producer", 64 * KIB)
        dst = memoryview(bytearray(4))
        try:
            peer.arena.buf[:4] = b"old!"
            ours.read(_meta(peer.address), dst)
            peer.arena.buf[:4] = b"new!"
            assert unlink_segment(peer.address)
            with pytest.raises(TransportError, match="does not exist"):
                ours.read(_meta(peer.address), dst)
            assert bytes(dst) == b"old!"
        finally:
            ShmTransport(namespace, "producer", 64 * KIB).close()  # settles the resource tracker
            peer.close()


def test_a_closing_peer_retires_its_segment_before_removing_it(namespace: str) -> None:
    with ShmTransport(namespace, "consumer", 64 * KIB) as ours:
        peer = ShmTransport(namespace, "producer", 64 * KIB)
        ours.read(_meta(peer.address), memoryview(bytearray(4)))
        cached = ours._peers[peer.address]
        # Keep a mapping of our own, as a reader mid-read would: it outlives the name.
        witness = Segment(peer.address)
        peer.close()
        try:
            assert _layout(witness).incarnation == 0
            assert not cached.current()
        finally:
            witness.close()
        with pytest.raises(TransportError, match="does not exist"):
            ours.read(_meta(peer.address), memoryview(bytearray(4)))


def test_a_closed_mapping_is_never_current(namespace: str) -> None:
    with (
        ShmTransport(namespace, "producer", 64 * KIB) as peer,
        ShmTransport(namespace, "consumer", 64 * KIB) as ours,
    ):
        ours.read(_meta(peer.address), memoryview(bytearray(4)))
        cached = ours._peers[peer.address]
        assert cached.current()
        cached.close()  # what eviction does, possibly under another thread's read
        assert cached.seg.fd == -1 and not cached.current()
        with pytest.raises(ValueError):
            cached.seg.view[0:4]  # and a read that got past the check finds the view released


def test_segments_of_older_producers_without_an_incarnation_are_read_and_checked_by_fstat(
    namespace: str,
) -> None:
    name = segment_name(namespace, "old-producer")
    capacity, slots = 4 * KIB, 16
    shm = shared_memory.SharedMemory(name, create=True, size=capacity + slots * TAG.size + DESCRIPTOR.size)
    try:
        DESCRIPTOR.pack_into(shm.buf, shm.size - DESCRIPTOR.size, DESCRIPTOR_MAGIC, capacity)
        shm.buf[:4] = b"v1!!"
        with ShmTransport(namespace, "consumer", 64 * KIB) as ours:
            dst = memoryview(bytearray(4))
            ours.read(_meta(name), dst)
            assert bytes(dst) == b"v1!!"
            (mapped,) = ours._peers.values()
            assert mapped.header == -1 and mapped.slots == slots and mapped.capacity == capacity
            assert not retire_segment(name)  # nothing to retire
            shm.unlink()
            with pytest.raises(TransportError, match="does not exist"):
                ours.read(_meta(name), dst)
    finally:
        shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def test_the_descriptor_layout_is_incarnation_then_magic_and_capacity(namespace: str) -> None:
    with ShmTransport(namespace, "producer", 64 * KIB) as peer:
        shm = peer._shm
        assert shm is not None
        magic, capacity = DESCRIPTOR.unpack_from(shm.buf, shm.size - DESCRIPTOR.size)
        assert (magic, capacity) == (b"T2ITAGS1", 64 * KIB)
        assert struct.unpack_from("<Q8s", shm.buf, shm.size - 32) == (peer.incarnation, b"T2IINC01")
        # A reader of the previous version (no header) sees one more tag slot, never named.
        room = shm.size - DESCRIPTOR.size - capacity
        assert room % TAG.size == 0 and room // TAG.size == peer.tags.slots + 1


def test_reads_racing_evictions_get_the_right_bytes_or_a_retryable_error(namespace: str) -> None:
    # max_peers=1: every read of the other peer evicts (closes) the mapping another thread may be
    # checking or reading through; its descriptor number may be reused meanwhile. 1 MiB reads:
    # the copy runs without the GIL, so evictions land during copies too.
    size = 1024 * KIB
    peers = [ShmTransport(namespace, f"producer{i}", 2 * size) for i in range(3)]
    try:
        for i, peer in enumerate(peers):
            peer.arena.buf[:size] = bytes([i + 1]) * size
        with ShmTransport(namespace, "consumer", 64 * KIB, max_peers=1) as ours:
            wrong: list[str] = []
            retried = [0]

            def reader(seed: int) -> None:
                dst = memoryview(bytearray(size))
                for n in range(100):
                    i = (seed + n) % len(peers)
                    try:
                        ours.read(_meta(peers[i].address, size), dst)
                    except TransportError as exc:
                        assert exc.retryable
                        retried[0] += 1
                        continue
                    if dst[0] != i + 1 or dst[size - 1] != i + 1 or bytes(dst).count(i + 1) != size:
                        wrong.append(f"peer {i}")

            threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert not wrong
            assert len(ours.peers) <= 1
    finally:
        for peer in peers:
            peer.close()


def test_a_predecessor_closing_after_its_successor_started_leaves_the_successors_segment(
    namespace: str,
) -> None:
    # The predecessor (its own process, as executors are) is still alive when its successor starts
    # under the same executor id (a slow shutdown), and closes afterwards: the name is the
    # successor's now and must stay, also when the predecessor's process exits.
    script = (
        "import sys; from libs.dataplane.transport import ShmTransport; "
        f"t = ShmTransport({namespace!r}, 'producer', 64 * 1024); print('up', flush=True); "
        "sys.stdin.readline(); t.close(); print('closed', flush=True)"
    )
    old = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert old.stdout is not None and old.stdin is not None
        assert old.stdout.readline().strip() == "up"
        new = ShmTransport(namespace, "producer", 64 * KIB)
        meta = TensorStore("producer", new).put(
            "r1/b", torch.full((64,), 7, dtype=torch.uint8), consumers=1, group="r1"
        )
        old.stdin.write("close\n")
        old.stdin.flush()
        assert old.stdout.readline().strip() == "closed"
        assert old.wait(30) == 0
    finally:
        old.kill()
    with ShmTransport(namespace, "consumer", 64 * KIB) as ours:
        out = bytearray(64)
        ours.read(meta, memoryview(out))  # raises TransportError if the name was removed
        assert out == bytes([7]) * 64
    new.close()
    with pytest.raises(FileNotFoundError):  # the successor still removes its own name
        shared_memory.SharedMemory(new.address)
