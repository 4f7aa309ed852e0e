"""Data-plane integrity: stale metadata is caught (tags), TCP peers authenticate, are capped and time out."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import libs.dataplane.transport.shm as shm_module
import libs.dataplane.transport.tcp as tcp_module
from libs.common.config import load_config
from libs.dataplane.errors import (
    AuthenticationError,
    PeerBusyError,
    StaleTensorError,
    TagTableFullError,
    TensorNotFoundError,
    TransportError,
)
from libs.dataplane.store import TensorStore
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport, make_transport
from libs.dataplane.transport.tags import MAX_SLOTS, TagTable, slots_for, tensor_key
from libs.dataplane.transport.wire import (
    AUTH,
    AUTH_MAGIC,
    AUTH_REPLY,
    FLAG_TOKEN,
    HELLO,
    REQUEST,
    STATUS_AUTH_FAILED,
    STATUS_BUSY,
    STATUS_OK,
    VERSION,
    resolve_token,
)
from libs.protocol.errors import BadTensorMetaError
from libs.protocol.tensor_meta import TensorMeta, check_meta, decode_meta, encode_meta
from services.executor.config import DataplaneSettings
from tests.support.waiting import until_sync

KIB = 1024
BOUND = 30.0  # upper bound on waits that normally take milliseconds
SHORT = 0.3  # the timeout the timeout tests configure


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = f"test{uuid.uuid4().hex[:8]}"
    yield ns
    leftovers = sorted(p.name for p in Path("/dev/shm").glob(f"t2i-{ns}-*"))
    for name in leftovers:
        os.unlink(f"/dev/shm/{name}")
    assert not leftovers, f"segments left behind: {leftovers}"


def _transport(kind: str, namespace: str, executor: str, capacity: int) -> Transport:
    if kind == "shm":
        return ShmTransport(namespace, executor, capacity)
    return TcpTransport("127.0.0.1", 0, capacity=capacity)


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest, namespace: str) -> Iterator[tuple[TensorStore, TensorStore]]:
    producer = _transport(request.param, namespace, "producer", 256 * KIB)
    consumer = _transport(request.param, namespace, "consumer", 256 * KIB)
    try:
        yield TensorStore("producer", producer, alloc_timeout=BOUND), TensorStore("consumer", consumer)
    finally:
        consumer.close()
        producer.close()


def _noise(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# --- the tag table ---------------------------------------------------------------------------------


def test_stamps_take_increasing_generations_and_freed_slots_come_back_oldest_first() -> None:
    table = TagTable(memoryview(bytearray(3 * 16)), 3, name="t", first_generation=10)
    stamps = [table.stamp(key) for key in (111, 222, 333)]
    assert stamps == [(0, 10), (1, 11), (2, 12)]
    assert table.read(1) == (11, 222) and table.held == 3
    with pytest.raises(TagTableFullError) as caught:
        table.stamp(444)
    assert caught.value.retryable
    table.clear(1)
    table.clear(1)  # a repeated clear must not free the slot twice
    table.clear(0)
    assert table.read(1) == (0, 0)
    assert table.check(1, 11, 222) is not None and table.check(2, 12, 333) is None
    assert table.stamp(555) == (1, 13)  # freed first, reused first; never an old generation
    assert table.stamp(666) == (0, 14)
    with pytest.raises(TagTableFullError):
        table.stamp(777)


def test_generations_start_at_random_so_a_restarted_producer_does_not_repeat_them() -> None:
    starts = {TagTable(None, 1).stamp(0)[1] for _ in range(8)}
    assert len(starts) == 8 and min(starts) >= 1


def test_tables_have_a_slot_per_minimum_block_up_to_a_bound() -> None:
    assert slots_for(64 * KIB, 256) == 256
    assert slots_for(1 << 40, 256) == MAX_SLOTS
    assert tensor_key("r/a", 0, 16) != tensor_key("r/b", 0, 16) != tensor_key("r/a", 256, 16)


def test_metadata_carries_generation_and_slot_and_rejects_bad_ones() -> None:
    good = TensorMeta("t", "e", "shm", "seg", 0, 4, "uint8", [4], generation=7, tag_slot=3)
    assert decode_meta(encode_meta(good)) == good
    fields = msgspec.structs.asdict(good)
    legacy = msgspec.msgpack.encode({k: v for k, v in fields.items() if k not in ("generation", "tag_slot")})
    assert (decode_meta(legacy).generation, decode_meta(legacy).tag_slot) == (0, 0)
    for field, value in [
        ("generation", -1),
        ("generation", 1 << 64),
        ("tag_slot", 1 << 32),
        ("tag_slot", True),
    ]:
        with pytest.raises(BadTensorMetaError) as caught:
            check_meta(msgspec.structs.replace(good, **{field: value}))
        assert caught.value.field == field


# --- stale metadata through the store --------------------------------------------------------------


def test_a_normal_pull_is_bitwise_and_carries_a_fresh_generation(
    pair: tuple[TensorStore, TensorStore],
) -> None:
    producer, consumer = pair
    tensor = _noise(1000, 1)
    first = producer.put("r1/a", tensor, consumers=1, group="r1")
    second = producer.put("r1/b", tensor, consumers=1, group="r1")
    assert 0 < first.generation < second.generation and first.tag_slot != second.tag_slot
    with consumer.open(first) as lease:
        assert torch.equal(lease.tensor.view(torch.uint8), tensor.view(torch.uint8))


def test_a_meta_whose_block_was_released_and_reused_by_another_tensor_raises_stale(
    pair: tuple[TensorStore, TensorStore],
) -> None:
    producer, consumer = pair
    old = producer.put("r1/1/a@0/out", _noise(1000, 1), consumers=1, group="r1")
    assert producer.release(old.tensor_id) is True
    with pytest.raises(StaleTensorError, match="released") as caught:
        consumer.open(old)  # freed, not reused yet
    new = producer.put("r2/1/b@0/out", _noise(1000, 2), consumers=1, group="r2")  # another tenant's
    assert new.offset == old.offset
    with pytest.raises(StaleTensorError) as caught:
        consumer.open(old)
    error = caught.value
    assert "r1/1/a@0/out" in str(error) and error.tensor_id == old.tensor_id and not error.retryable
    assert consumer.stats()["used"] == 0
    with consumer.open(new) as lease:
        assert torch.equal(lease.tensor, _noise(1000, 2))


def test_metadata_naming_another_generation_or_slot_is_stale(pair: tuple[TensorStore, TensorStore]) -> None:
    producer, consumer = pair
    meta = producer.put("r1/a", _noise(100, 1), consumers=1, group="r1")
    for forged in (
        msgspec.structs.replace(meta, generation=meta.generation + 1),
        msgspec.structs.replace(meta, tag_slot=meta.tag_slot + 1),
        msgspec.structs.replace(meta, tag_slot=1 << 31),
        msgspec.structs.replace(meta, tensor_id="r9/other"),
    ):
        with pytest.raises(StaleTensorError):
            consumer.open(forged)
    assert consumer.stats()["used"] == 0


@pytest.mark.parametrize("numel", [4000, 32 * KIB], ids=["small", "large"])  # TCP: one send, or streamed
def test_a_block_freed_and_reused_while_it_is_being_read_is_caught_after_the_copy(
    pair: tuple[TensorStore, TensorStore], monkeypatch: pytest.MonkeyPatch, numel: int
) -> None:
    producer, consumer = pair
    old = producer.put("r1/a", _noise(numel, 1), consumers=1, group="r1")
    reused: list[TensorMeta] = []

    def reuse_during_the_copy() -> None:
        if not reused:  # the producer frees the block and another tensor takes it, mid-read
            producer.release(old.tensor_id)
            reused.append(producer.put("r2/b", _noise(numel, 2), consumers=1, group="r2"))

    def then_reuse(read: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            result = read(*args)
            reuse_during_the_copy()
            return result

        return wrapped

    if producer.transport.kind == "shm":
        monkeypatch.setattr(shm_module, "copy_bytes", then_reuse(shm_module.copy_bytes))
    else:
        monkeypatch.setattr(tcp_module, "_snapshot", then_reuse(tcp_module._snapshot))
        monkeypatch.setattr(tcp_module, "_send_chunks", then_reuse(tcp_module._send_chunks))
    with pytest.raises(StaleTensorError, match="r1/a"):
        consumer.open(old)
    assert reused and reused[0].offset == old.offset
    assert consumer.stats()["used"] == 0
    with consumer.open(reused[0]) as lease:  # the connection or mapping still serves fresh reads
        assert torch.equal(lease.tensor, _noise(numel, 2))


def test_opening_our_own_tensor_by_an_older_generation_is_stale(
    pair: tuple[TensorStore, TensorStore],
) -> None:
    producer, _ = pair
    old = producer.put("r1/a", torch.ones(10), consumers=1, group="r1")
    producer.release("r1/a")
    with pytest.raises(TensorNotFoundError):
        producer.open(old)
    new = producer.put("r1/a", torch.zeros(10), consumers=1, group="r1")  # a node that ran again
    assert new.offset == old.offset
    with pytest.raises(StaleTensorError, match="r1/a"):
        producer.open(old)
    with producer.open(new) as lease:
        assert torch.equal(lease.tensor, torch.zeros(10))


def test_release_group_and_discard_clear_their_tags(pair: tuple[TensorStore, TensorStore]) -> None:
    producer, consumer = pair
    metas = [producer.put(f"r1/{i}", torch.ones(8), consumers=2, group="r1") for i in range(3)]
    assert producer.transport.tags.held == 3
    producer.discard("r1/0")
    assert producer.release_group("r1") == 2
    assert producer.transport.tags.held == 0
    for meta in metas:
        with pytest.raises(StaleTensorError):
            consumer.open(meta)


# --- TCP: tokens -----------------------------------------------------------------------------------


def _tcp(**kwargs: object) -> TcpTransport:
    return TcpTransport("127.0.0.1", capacity=64 * KIB, **kwargs)  # type: ignore[arg-type]


def _peer_meta(peer: TcpTransport, nbytes: int = 4) -> TensorMeta:
    return TensorMeta("r1/x", "producer", "tcp", peer.address, 0, nbytes, "uint8", [nbytes])


def test_peers_sharing_a_token_read_and_a_wrong_or_missing_token_is_refused() -> None:
    with _tcp(token="s3cret") as peer, _tcp(token="s3cret") as ours:
        peer.arena.buf[:4] = b"auth"
        dst = memoryview(bytearray(4))
        ours.read(_peer_meta(peer), dst)
        assert bytes(dst) == b"auth" and peer.authenticated
        for token, why in [("wrong", "rejected our token"), ("", "requires a token")]:
            with _tcp(token=token) as stranger:
                with pytest.raises(AuthenticationError, match=why) as caught:
                    stranger.read(_peer_meta(peer), memoryview(bytearray(4)))
                assert not caught.value.retryable
        assert peer._server.rejected == 1


def test_a_client_with_a_token_refuses_a_server_without_one() -> None:
    with _tcp(token="") as open_peer, _tcp(token="s3cret") as ours:
        with pytest.raises(AuthenticationError, match="does not authenticate"):
            ours.read(_peer_meta(open_peer), memoryview(bytearray(4)))


def test_an_executor_passes_the_token_of_its_settings_to_its_transport(namespace: str) -> None:
    token = load_config(DataplaneSettings, "T2I_DATAPLANE_", {"T2I_DATAPLANE_TOKEN": "from-env"}).secret()
    with (
        make_transport("tcp", namespace=namespace, executor_id="p", capacity=64 * KIB, token=token) as peer,
        _tcp(token="from-env") as ours,
        _tcp() as without,
    ):
        assert isinstance(peer, TcpTransport) and peer.authenticated and not without.authenticated
        peer.arena.buf[:3] = b"env"
        dst = memoryview(bytearray(3))
        ours.read(_peer_meta(peer, 3), dst)  # type: ignore[arg-type]
        assert bytes(dst) == b"env"
        with pytest.raises(AuthenticationError):
            without.read(_peer_meta(peer, 3), dst)  # type: ignore[arg-type]


def test_the_token_may_come_from_a_mounted_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")

    def secret(**env: str) -> str:
        return load_config(DataplaneSettings, "T2I_DATAPLANE_", env).secret()

    assert secret(T2I_DATAPLANE_TOKEN_FILE=str(tmp_path / "token")) == "from-file"
    assert secret() == "" and resolve_token("") is None and resolve_token("explicit") == b"explicit"
    with pytest.raises(ValueError, match="not both"):
        secret(T2I_DATAPLANE_TOKEN="both", T2I_DATAPLANE_TOKEN_FILE=str(tmp_path / "token"))
    with pytest.raises(ValueError, match="cannot read"):
        secret(T2I_DATAPLANE_TOKEN_FILE=str(tmp_path / "missing"))


def _hello(sock: socket.socket) -> tuple[bytes, int, int, int, bytes]:
    return HELLO.unpack(sock.recv(HELLO.size, socket.MSG_WAITALL))


def test_an_unauthenticated_connection_gets_no_bytes_and_is_closed() -> None:
    with _tcp(token="s3cret") as peer:
        peer.arena.buf[:8] = b"SECRET!!"
        with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as sock:
            magic, version, status, flags, nonce = _hello(sock)
            assert (magic, version, status, flags) == (b"T2IH", VERSION, STATUS_OK, FLAG_TOKEN)
            sock.sendall(AUTH.pack(AUTH_MAGIC, VERSION, 0, os.urandom(32), os.urandom(32)))
            _, _, status, _ = AUTH_REPLY.unpack(sock.recv(AUTH_REPLY.size, socket.MSG_WAITALL))
            assert status == STATUS_AUTH_FAILED
            rest = b""
            while chunk := sock.recv(4096):
                rest += chunk
            assert rest == b""  # closed, nothing more
        with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as sock:
            _hello(sock)  # skips the handshake and asks for the bytes straight away
            sock.sendall(REQUEST.pack(b"T2IR", VERSION, 1, 0, 8, 0, 0, 0, 0) + bytes(24))
            received = b""
            while chunk := sock.recv(4096):
                received += chunk
            assert b"SECRET" not in received


# --- TCP: connection cap and timeouts ---------------------------------------------------------------


class _Pauses:
    """The tcp module's ``time`` in a test: the pauses it asks for are recorded, not waited out
    (how long a pause lasts is ``time.sleep``'s business; ``bench/tcp_timeouts.py`` measures it)."""

    def __init__(self) -> None:
        self.taken: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.taken.append(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_connections_beyond_the_cap_are_refused_until_one_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    with _tcp(max_connections=2) as peer, _tcp() as ours:
        held = [socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) for _ in range(2)]
        try:
            for sock in held:  # handshaking: neither can be closed to make room
                assert _hello(sock)[2] == STATUS_OK
            counted = until_sync(lambda: peer._server.connections == 2, BOUND)
            assert counted, "the server never counted the connections"
            with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as extra:
                assert _hello(extra)[2] == STATUS_BUSY and extra.recv(1) == b""
            pauses = _Pauses()
            with monkeypatch.context() as patched:
                patched.setattr(tcp_module, "time", pauses)
                with pytest.raises(PeerBusyError, match="too many") as caught:
                    ours.read(_peer_meta(peer), memoryview(bytearray(4)))
            assert caught.value.retryable and isinstance(caught.value, TransportError)
            # Backed off: four tries, with each pause of the schedule before the next, then gave up.
            assert peer._server.refused == 1 + 4 and pauses.taken == list(tcp_module._BUSY_RETRIES)
        finally:
            held.pop().close()
        forgotten = until_sync(lambda: peer._server.connections < 2, BOUND)
        assert forgotten, "a closed connection was never forgotten"
        ours.read(_peer_meta(peer), memoryview(bytearray(4)))
        for sock in held:
            sock.close()


def _all_idle(server) -> bool:
    """Whether every connection the server keeps (the evicted ones aside) waits for a request."""
    with server._lock:
        return len(server._idle) == len(server._conns) - len(server._evicted)


def test_at_the_cap_the_longest_idle_pooled_connection_makes_room() -> None:
    with _tcp(max_connections=2) as peer:
        peer.arena.buf[:4] = b"pool"
        clients = [_tcp() for _ in range(3)]
        try:
            for _ in range(2):  # every client's second read reuses, or replaces, its connection
                for client in clients:
                    # A connection whose answer the last client has is idle a moment later, once
                    # its thread is back waiting for a request (the server cannot tell before):
                    # the next client comes once it is, so there is an idle one to make room.
                    assert until_sync(lambda: _all_idle(peer._server), BOUND), "a connection stays busy"
                    dst = memoryview(bytearray(4))
                    client.read(_peer_meta(peer), dst)
                    assert bytes(dst) == b"pool"
            assert peer._server.refused == 0
            assert until_sync(lambda: peer._server.connections <= 2, BOUND), "evicted connections linger"
        finally:
            for client in clients:
                client.close()


def _timed_out(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The server's log lines for connections it dropped because its timeout ran out."""
    return [r.getMessage() for r in caplog.records if "silent for" in r.getMessage()]


def test_a_client_that_connects_and_sends_nothing_is_dropped_after_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The server logs a drop for its timeout before it hangs up: what a client sees comes after.
    caplog.set_level(logging.DEBUG, logger=tcp_module.__name__)
    with _tcp(timeout=SHORT) as peer:
        with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as silent:
            _hello(silent)
            assert silent.recv(1) == b""  # the server hung up
            # ... because the client was silent for the timeout it was given (not at once, nor
            # after a default): the drop is the timeout's, with its length.
            (why,) = _timed_out(caplog)
            assert why.endswith(f"silent for {SHORT:.1f}s"), why
        with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as trickler:
            _hello(trickler)
            dropped = False
            for _ in range(AUTH.size - 1):  # a byte per SHORT / 3: each recv alone would not time out
                try:
                    trickler.sendall(b"T")
                    readable, _, _ = select.select([trickler], [], [], SHORT / 3)
                    dropped = bool(readable) and trickler.recv(1) == b""
                except OSError:
                    dropped = True
                if dropped:
                    break
            # Dropped before its frame was complete, though no recv waited a whole timeout: the
            # handshake as a whole has run out of time (the server says it timed out).
            assert dropped, "a trickling client held the handshake open"
            assert len(_timed_out(caplog)) == 2, caplog.text
        forgotten = until_sync(lambda: peer._server.connections == 0, BOUND)
        assert forgotten, "dropped connections were never forgotten"


def test_a_pooled_connection_the_server_dropped_for_idleness_is_replaced() -> None:
    with _tcp(timeout=SHORT) as peer, _tcp(timeout=SHORT) as ours:
        peer.arena.buf[:4] = b"idle"
        dst = memoryview(bytearray(4))
        ours.read(_peer_meta(peer), dst)
        assert until_sync(lambda: peer._server.connections == 0, BOUND), "the idle connection was kept"
        dst[:] = b"...."
        ours.read(_peer_meta(peer), dst)
        assert bytes(dst) == b"idle"


def test_a_server_that_never_answers_fails_the_read_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bounds: list[tuple[float, float | None]] = []  # per handshake: its time limit, its socket's
    handshake = tcp_module.client_handshake

    def bounded(sock: socket.socket, token: bytes | None, address: str, timeout: float) -> None:
        bounds.append((timeout, sock.gettimeout()))
        handshake(sock, token, address, timeout)

    monkeypatch.setattr(tcp_module, "client_handshake", bounded)
    with socket.create_server(("127.0.0.1", 0)) as mute, _tcp(timeout=SHORT) as ours:
        with pytest.raises(TransportError, match="timed out") as caught:
            ours.read(_peer_meta_at(mute.getsockname()[1]), memoryview(bytearray(4)))
        # The mute server neither sends nor closes: only a deadline ends the wait, and the one
        # handshake there was had the configured timeout (not a default) as its deadline.
        assert caught.value.retryable and bounds == [(SHORT, SHORT)]


def _peer_meta_at(port: int) -> TensorMeta:
    return TensorMeta("r1/x", "producer", "tcp", f"127.0.0.1:{port}", 0, 4, "uint8", [4])


def test_the_server_keeps_serving_others_while_one_client_stalls() -> None:
    with _tcp(timeout=BOUND) as peer, _tcp() as ours:
        peer.arena.buf[:4] = b"live"
        with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as stalled:
            _hello(stalled)
            reads = [
                threading.Thread(target=ours.read, args=(_peer_meta(peer), memoryview(bytearray(4))))
                for _ in range(3)
            ]
            for thread in reads:
                thread.start()
            for thread in reads:
                thread.join(timeout=BOUND)
            assert not any(thread.is_alive() for thread in reads)


def test_make_transport_passes_the_tcp_settings(namespace: str) -> None:
    with make_transport(
        "tcp",
        namespace=namespace,
        executor_id="e",
        capacity=64 * KIB,
        token="t",
        timeout=5.0,
        max_connections=3,
    ) as transport:
        assert isinstance(transport, TcpTransport) and transport.authenticated
        assert transport._server._max_connections == 3 and transport._server._timeout == 5.0
    with pytest.raises(ValueError, match="max_connections"):
        _tcp(max_connections=0)
