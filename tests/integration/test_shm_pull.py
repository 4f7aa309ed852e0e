"""Peer-to-peer pulls between real processes over shared memory and TCP (paper §5.2)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.dataplane.arena import segment_exists, segment_name
from libs.dataplane.errors import StaleTensorError, TransportError
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport
from libs.dataplane.transport.wire import (
    REPLY,
    REQUEST,
    REQUEST_MAGIC,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    TRAILER,
    VERSION,
    client_handshake,
    resolve_token,
)
from libs.protocol.tensor_meta import TensorMeta, decode_meta, encode_meta

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BOUND = 120.0  # upper bound on any wait for the other process (spawn imports torch)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A namespace unique to this test; fails the test if it leaves segments behind (and removes them)."""
    ns = f"test{uuid.uuid4().hex[:8]}"
    yield ns
    leftovers = sorted(p.name for p in Path("/dev/shm").glob(f"t2i-{ns}-*"))
    for name in leftovers:
        os.unlink(f"/dev/shm/{name}")
    assert not leftovers, f"segments left behind: {leftovers}"


def _make_transport(kind: str, namespace: str, executor: str, capacity: int) -> Transport:
    if kind == "shm":
        return ShmTransport(namespace, executor, capacity)
    return TcpTransport("127.0.0.1", 0, capacity=capacity)


def _expected(shape: list[int], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _producer_main(conn: Connection, kind: str, namespace: str, capacity: int) -> None:
    """A producer executor: owns an arena and a store, obeys commands from the pipe."""
    transport = _make_transport(kind, namespace, "producer", capacity)
    try:
        store = TensorStore("producer", transport, alloc_timeout=BOUND)
        conn.send(("ready", transport.address))
        while True:
            cmd, *args = conn.recv()
            if cmd == "put":
                tensor_id, shape, seed = args
                meta = store.put(tensor_id, _expected(shape, seed), consumers=1, group="r1")
                conn.send(("meta", encode_meta(meta)))
            elif cmd == "release":
                conn.send(("released", store.release(args[0]), store.stats()))
            elif cmd == "reuse":  # free a tensor and put another one, in the same block
                old_id, new_id, shape, seed = args
                store.release(old_id)
                meta = store.put(new_id, _expected(shape, seed), consumers=1, group="r2")
                conn.send(("meta", encode_meta(meta)))
            elif cmd == "stats":
                conn.send(("stats", store.stats()))
            else:
                break
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        conn.send(("error", repr(exc)))
    finally:
        transport.close()
        conn.send(("stopped",))


class Producer:
    """The test's handle on a producer process."""

    def __init__(self, kind: str, namespace: str, capacity: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_producer_main, args=(child, kind, namespace, capacity), daemon=True
        )
        self.process.start()
        child.close()
        self.address: str = self.ask()[1]

    def ask(self, *command: Any) -> tuple[Any, ...]:
        if command:
            self.conn.send(command)
        if not self.conn.poll(BOUND):
            raise TimeoutError(f"producer did not answer {command!r}")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise AssertionError(f"producer failed: {reply[1]}")
        return tuple(reply)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
                if self.conn.poll(BOUND):
                    self.conn.recv()
            except (BrokenPipeError, EOFError, ConnectionResetError):
                pass
        self.process.join(timeout=BOUND)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture(params=["shm", "tcp"])
def producer(request: pytest.FixtureRequest, namespace: str) -> Iterator[Producer]:
    handle = Producer(request.param, namespace, 64 * MIB)
    try:
        yield handle
    finally:
        handle.stop()


def test_a_tensor_put_by_another_process_is_pulled_bitwise_and_freed_after_release(
    producer: Producer, namespace: str
) -> None:
    meta = decode_meta(producer.ask("put", "r1/1/transformer@0/noise_pred", [4, 64, 128], 7)[1])
    assert meta.executor == "producer" and meta.address == producer.address
    with _make_transport(meta.transport, namespace, "consumer", 64 * MIB) as transport:
        consumer = TensorStore("consumer", transport)
        with consumer.open(meta) as lease:
            assert not lease.local and lease.transferred_bytes == 4 * 64 * 128 * 4
            assert torch.equal(lease.tensor, _expected([4, 64, 128], 7))
        assert consumer.stats()["used"] == 0
    assert producer.ask("stats")[1]["tensors"] == 1
    _, freed, stats = producer.ask("release", meta.tensor_id)
    assert freed is True
    assert stats["used"] == 0 and stats["tensors"] == 0


def test_a_stale_meta_from_another_process_raises_stale_tensor_never_the_new_bytes(
    producer: Producer, namespace: str
) -> None:
    old = decode_meta(producer.ask("put", "r1/1/a@0/out", [64, 64], 1)[1])
    new = decode_meta(producer.ask("reuse", old.tensor_id, "r2/1/b@0/out", [64, 64], 2)[1])
    assert new.offset == old.offset and new.generation > old.generation  # the block was reused
    with _make_transport(old.transport, namespace, "consumer", 64 * MIB) as transport:
        consumer = TensorStore("consumer", transport)
        with pytest.raises(StaleTensorError, match="r1/1/a@0/out") as caught:
            consumer.open(old)
        assert not caught.value.retryable and caught.value.tensor_id == old.tensor_id
        assert consumer.stats()["used"] == 0
        with consumer.open(new) as lease:
            assert torch.equal(lease.tensor, _expected([64, 64], 2))


_CONSUMER_SCRIPT = """
import hashlib, sys
from libs.protocol.tensor_meta import decode_meta
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import ShmTransport
meta = decode_meta(sys.stdin.buffer.read())
with ShmTransport(sys.argv[1], "consumer", 1 << 20) as transport:
    with TensorStore("consumer", transport).open(meta) as lease:
        print(hashlib.sha256(lease.tensor.numpy().tobytes()).hexdigest())
"""


def test_the_producers_segment_survives_a_consumer_process_exiting(namespace: str) -> None:
    # The consumer is a separate interpreter with its own resource tracker, like an executor
    # started by a supervisor: had it attached with SharedMemory, its tracker would unlink the
    # producer's arena when it exits.
    tensor = _expected([64, 64], 3)
    with ShmTransport(namespace, "producer", 1 * MIB) as transport:
        store = TensorStore("producer", transport)
        meta = store.put("r1/x", tensor, consumers=2, group="r1")
        done = subprocess.run(
            [sys.executable, "-c", _CONSUMER_SCRIPT, namespace],
            input=encode_meta(meta),
            capture_output=True,
            cwd=REPO,
            timeout=BOUND,
        )
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode().strip() == hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        assert b"resource_tracker" not in done.stderr and b"leaked" not in done.stderr
        assert segment_exists(transport.address)
        with (
            ShmTransport(namespace, "second", 1 * MIB) as other,
            TensorStore("second", other).open(meta) as lease,
        ):
            assert torch.equal(lease.tensor, tensor)


def _uint8_meta(address: str, offset: int, nbytes: int, transport: str = "shm") -> TensorMeta:
    return TensorMeta("r1/x", "producer", transport, address, offset, nbytes, "uint8", [nbytes])


def test_reading_beyond_the_peer_segment_raises_transport_error(namespace: str) -> None:
    with (
        ShmTransport(namespace, "producer", 64 * 1024) as peer,
        ShmTransport(namespace, "consumer", MIB) as ours,
    ):
        store = TensorStore("consumer", ours)
        for offset, nbytes in [(64 * 1024 - 256, 1024), (1 << 40, 16)]:
            with pytest.raises(TransportError, match="outside"):
                ours.read(_uint8_meta(peer.address, offset, nbytes), memoryview(bytearray(nbytes)))
        with pytest.raises(TransportError):
            store.open(_uint8_meta(peer.address, 64 * 1024 - 256, 1024))
        assert store.stats()["used"] == 0


def test_pulling_from_a_missing_or_departed_peer_raises_transport_error(namespace: str) -> None:
    with ShmTransport(namespace, "consumer", MIB) as ours:
        ghost = _uint8_meta(segment_name(namespace, "ghost"), 0, 16)
        with pytest.raises(TransportError, match="does not exist") as caught:
            ours.read(ghost, memoryview(bytearray(16)))
        assert caught.value.retryable
        peer = ShmTransport(namespace, "producer", 64 * 1024)
        meta = _uint8_meta(peer.address, 0, 16)
        ours.read(meta, memoryview(bytearray(16)))  # maps and caches the peer
        peer.close()
        with pytest.raises(TransportError, match="does not exist"):
            ours.read(meta, memoryview(bytearray(16)))  # the cached mapping is not read stale


def test_a_peer_restarted_under_the_same_name_is_mapped_afresh(namespace: str) -> None:
    with ShmTransport(namespace, "consumer", MIB) as ours:
        dst = memoryview(bytearray(4))
        first = ShmTransport(namespace, "producer", 64 * 1024)
        first.arena.buf[:4] = b"old!"
        ours.read(_uint8_meta(first.address, 0, 4), dst)
        assert bytes(dst) == b"old!"
        first.close()
        with ShmTransport(namespace, "producer", 64 * 1024) as second:
            second.arena.buf[:4] = b"new!"
            ours.read(_uint8_meta(second.address, 0, 4), dst)
            assert bytes(dst) == b"new!"


def test_tcp_reads_outside_the_peer_arena_get_an_error_reply_and_the_server_keeps_serving() -> None:
    with (
        TcpTransport("127.0.0.1", capacity=64 * 1024) as peer,
        TcpTransport("127.0.0.1", capacity=MIB) as ours,
    ):
        peer.arena.buf[:4] = b"tcp!"
        with pytest.raises(TransportError, match="outside"):
            ours.read(_uint8_meta(peer.address, 64 * 1024 - 256, 1024, "tcp"), memoryview(bytearray(1024)))
        dst = memoryview(bytearray(4))
        ours.read(_uint8_meta(peer.address, 0, 4, "tcp"), dst)
        assert bytes(dst) == b"tcp!"


def _raw_exchange(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    sock.sendall(request)
    header = sock.recv(REPLY.size, socket.MSG_WAITALL)
    magic, version, status, length = REPLY.unpack(header)
    assert magic == b"T2IA" and version == VERSION
    body = sock.recv(length, socket.MSG_WAITALL) if length else b""
    if status == STATUS_OK:  # data is followed by the trailer (the after-send tag check)
        assert TRAILER.unpack(sock.recv(TRAILER.size, socket.MSG_WAITALL)) == (b"T2IE", STATUS_OK, 0)
    return status, body


def _raw_read(op: int, offset: int, nbytes: int, version: int = VERSION) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, version, op, offset, nbytes, 0, 0, 0, 0)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
    client_handshake(sock, resolve_token(None), f"127.0.0.1:{port}", BOUND)
    return sock


def test_tcp_server_answers_malformed_requests_with_errors_and_survives() -> None:
    with TcpTransport("127.0.0.1", capacity=64 * 1024) as peer:
        peer.arena.buf[:4] = b"ok!!"
        with _connect(peer.port) as sock:
            status, message = _raw_exchange(sock, _raw_read(99, 0, 4))
            assert status == STATUS_BAD_REQUEST and b"op" in message
            status, message = _raw_exchange(sock, _raw_read(1, 0, 4, version=7))
            assert status == STATUS_BAD_REQUEST and b"version" in message
            status, data = _raw_exchange(sock, _raw_read(1, 0, 4))
            assert (status, data) == (STATUS_OK, b"ok!!")
        with _connect(peer.port) as sock:
            status, message = _raw_exchange(
                sock, (b"GET / HTTP/1.1\r\n" + b"x" * REQUEST.size)[: REQUEST.size]
            )
            assert status == STATUS_BAD_REQUEST and b"magic" in message
            assert sock.recv(1) == b""  # an unframed stream is closed
        with TcpTransport("127.0.0.1", capacity=MIB) as ours:
            dst = memoryview(bytearray(4))
            ours.read(_uint8_meta(peer.address, 0, 4, "tcp"), dst)
            assert bytes(dst) == b"ok!!"


def test_tcp_pull_from_a_peer_nobody_listens_on_raises_transport_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with TcpTransport("127.0.0.1", capacity=MIB) as ours:
        with pytest.raises(TransportError, match="cannot connect") as caught:
            ours.read(_uint8_meta(f"127.0.0.1:{port}", 0, 4, "tcp"), memoryview(bytearray(4)))
        assert caught.value.retryable


def test_tcp_reconnects_after_the_peer_drops_a_pooled_connection() -> None:
    with (
        TcpTransport("127.0.0.1", capacity=64 * 1024) as peer,
        TcpTransport("127.0.0.1", capacity=MIB) as ours,
    ):
        peer.arena.buf[:4] = b"one!"
        meta = _uint8_meta(peer.address, 0, 4, "tcp")
        dst = memoryview(bytearray(4))
        ours.read(meta, dst)
        # The peer's server drops every connection (as a restart or an idle timeout would).
        peer._server.drop_connections()
        peer.arena.buf[:4] = b"two!"
        ours.read(meta, dst)
        assert bytes(dst) == b"two!"
