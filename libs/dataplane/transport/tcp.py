"""TCP transport: pull tensors from executors on other hosts or in other containers.

There is no remote memory access over plain TCP, so each executor runs a small threaded server
that answers "read ``nbytes`` at ``offset``" from its arena; the executor's own code is not
involved (the server threads read the arena as a shared-memory peer would). The frames and the
handshake are in ``wire.py``.

Security (docs/dataplane.md). With a shared token (``token=``; an executor passes its
``T2I_DATAPLANE_TOKEN`` or ``T2I_DATAPLANE_TOKEN_FILE``) every connection authenticates both ways before any read (HMACs
over two nonces; the token never crosses the wire); a bad MAC gets an error reply and the
connection is closed. A server holds at most ``max_connections`` (excess ones get a "busy" hello
and are closed), and every socket operation, each handshake as a whole and connecting are
bounded by ``timeout``: a client that connects and sends nothing is dropped.

Integrity: a request names the tensor's tag (slot, generation, key: ``tags.py``); the server
checks it against its arena's tag table before sending (error reply: stale) and after (the
trailer), so bytes of a block freed during the send are never used.

Every header is validated on both sides. A malformed request gets an error reply, never a crash;
a bad magic closes the connection (the stream can no longer be trusted to be framed).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections import defaultdict

from libs.dataplane.arena import HeapArena
from libs.dataplane.errors import DataPlaneError, PeerBusyError, TransportError
from libs.dataplane.transport.base import COPY_CHUNK, Transport
from libs.dataplane.transport.tags import TAG, TagTable, meta_key, slots_for, stale
from libs.dataplane.transport.wire import (
    AUTH,
    AUTH_MAGIC,
    AUTH_REPLY,
    AUTH_REPLY_MAGIC,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    FLAG_TOKEN,
    HELLO,
    HELLO_MAGIC,
    MAX_ERROR_MESSAGE,
    NO_MAC,
    OP_READ,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    STATUS_AUTH_FAILED,
    STATUS_BAD_REQUEST,
    STATUS_BUSY,
    STATUS_OK,
    STATUS_OUT_OF_RANGE,
    STATUS_STALE,
    STATUS_UNAVAILABLE,
    TRAILER,
    TRAILER_MAGIC,
    VERSION,
    client_handshake,
    handshake_mac,
    parse_address,
    recv_exactly,
    recv_frame,
    resolve_token,
)
from libs.protocol.tensor_meta import TensorMeta

log = logging.getLogger(__name__)

_MAX_IDLE_PER_PEER = 4
_BUSY_RETRIES = (0.05, 0.2, 0.5)  # seconds before each new try when a peer is at its connection cap
_SMALL_REPLY = 64 << 10  # replies up to this size are copied and sent with one syscall


def _snapshot(data: memoryview) -> bytes:
    """A copy of a small block, sent with its header and trailer in one go."""
    return bytes(data)


def _hang_up(sock: socket.socket) -> None:
    """shutdown() (not just close()) is what wakes a thread blocked in recv() on Linux."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _send_chunks(sock: socket.socket, data: memoryview) -> None:
    """sendall in COPY_CHUNK pieces: a socket timeout bounds each piece, not the whole tensor."""
    for start in range(0, data.nbytes, COPY_CHUNK):
        sock.sendall(data[start : start + COPY_CHUNK])


class _Server:
    """Accepts connections and answers read requests from ``arena`` with one thread per connection."""

    def __init__(
        self,
        arena: HeapArena,
        tags: TagTable,
        host: str,
        port: int,
        *,
        token: bytes | None,
        max_connections: int,
        timeout: float,
    ) -> None:
        self._arena = arena
        self._tags = tags
        self._token = token
        self._max_connections = max_connections
        self._timeout = timeout
        self._listener = socket.create_server((host, port), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        # Authenticated connections waiting for their next request, and since when: at the cap the
        # longest idle one is closed to make room (its client reconnects on its next read).
        self._idle: dict[socket.socket, float] = {}
        self._evicted: set[socket.socket] = set()  # hung up on, their threads not finished yet
        self._closed = False
        self.refused = 0  # connections turned away because max_connections were open
        self.rejected = 0  # connections that failed to authenticate
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"t2i-tcp-accept-{self.port}", daemon=True
        )
        self._accepter.start()

    @property
    def connections(self) -> int:
        """Connections open now (authenticated or still handshaking)."""
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name=f"t2i-tcp-{peer}", daemon=True
            )
            victim: socket.socket | None = None
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                busy = len(self._conns) - len(self._evicted) >= self._max_connections
                if busy and self._idle:
                    victim = min(self._idle, key=self._idle.__getitem__)
                    del self._idle[victim]
                    self._evicted.add(victim)
                    busy = False
                if not busy:
                    self._conns[conn] = thread
            if victim is not None:
                _hang_up(victim)
            if busy:
                self._refuse(conn, peer)
            else:
                thread.start()

    def _refuse(self, conn: socket.socket, peer: object) -> None:
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # 1st, 2nd, 4th, ...: visible, never a flood
            log.warning(
                "tcp transport: refused %s: %d connections open (%d refused)",
                peer,
                self._max_connections,
                self.refused,
            )
        conn.setblocking(False)  # 44 bytes into an empty socket buffer; never block the accept loop
        try:
            conn.send(HELLO.pack(HELLO_MAGIC, VERSION, STATUS_BUSY, 0, NO_MAC))
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        header = bytearray(REQUEST.size)
        try:
            conn.settimeout(self._timeout)
            if self._handshake(conn, peer):
                while True:
                    with self._lock:
                        if conn in self._evicted:
                            break
                        self._idle[conn] = time.monotonic()
                    got = recv_exactly(conn, memoryview(header))
                    with self._lock:
                        self._idle.pop(conn, None)
                    if not got or not self._answer(conn, header):
                        break
        except TimeoutError:
            log.debug("tcp transport: dropped %s: silent for %.1fs", peer, self._timeout)
        except OSError:
            pass  # client went away mid-request; nothing to answer
        except Exception:  # a bug must not kill the server, only this connection
            log.exception("tcp transport: error while serving a read")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._idle.pop(conn, None)
                self._evicted.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, peer: object) -> bool:
        """Hello, the client's auth frame, our reply; False (close) unless the client may read."""
        deadline = time.monotonic() + self._timeout
        nonce = os.urandom(32)
        conn.sendall(HELLO.pack(HELLO_MAGIC, VERSION, STATUS_OK, FLAG_TOKEN if self._token else 0, nonce))
        magic, version, _, client_nonce, mac = recv_frame(conn, AUTH, deadline)
        conn.settimeout(self._timeout)
        if magic != AUTH_MAGIC or version != VERSION:
            conn.sendall(AUTH_REPLY.pack(AUTH_REPLY_MAGIC, VERSION, STATUS_BAD_REQUEST, NO_MAC))
            return False
        proof = NO_MAC
        if self._token is not None:
            if not hmac.compare_digest(mac, handshake_mac(self._token, b"client", nonce, client_nonce)):
                self.rejected += 1
                log.warning("tcp transport: %s failed to authenticate (%d so far)", peer, self.rejected)
                conn.sendall(AUTH_REPLY.pack(AUTH_REPLY_MAGIC, VERSION, STATUS_AUTH_FAILED, NO_MAC))
                return False
            proof = handshake_mac(self._token, b"server", nonce, client_nonce)
        conn.sendall(AUTH_REPLY.pack(AUTH_REPLY_MAGIC, VERSION, STATUS_OK, proof))
        return True

    def _answer(self, conn: socket.socket, header: bytearray) -> bool:
        """Answer one request; False when the connection must be closed."""
        magic, version, op, offset, nbytes, slot, _, generation, key = REQUEST.unpack(header)
        if magic != REQUEST_MAGIC:
            self._error(conn, STATUS_BAD_REQUEST, f"bad magic {bytes(magic)!r}")
            return False
        if version != VERSION:
            self._error(conn, STATUS_BAD_REQUEST, f"unsupported version {version}")
            return True
        if op != OP_READ:
            self._error(conn, STATUS_BAD_REQUEST, f"unknown op {op}")
            return True
        capacity = self._arena.capacity
        if offset + nbytes > capacity:
            self._error(
                conn,
                STATUS_OUT_OF_RANGE,
                f"range [{offset}, {offset + nbytes}) outside arena of {capacity} bytes",
            )
            return True
        if generation and (reason := self._tags.check(slot, generation, key)) is not None:
            self._error(conn, STATUS_STALE, reason)
            return True
        try:
            data = self._arena.view(offset, nbytes)
        except (DataPlaneError, ValueError) as exc:
            self._error(conn, STATUS_UNAVAILABLE, str(exc))
            return True
        header = REPLY.pack(REPLY_MAGIC, VERSION, STATUS_OK, nbytes)
        small = nbytes <= _SMALL_REPLY  # copied, checked, then sent with one syscall
        with data:
            if small:
                header += _snapshot(data)
            else:
                conn.sendall(header)
                _send_chunks(conn, data)
        # The producer clears a tag before it frees the block: still there, the bytes were intact.
        after = STATUS_STALE if generation and self._tags.check(slot, generation, key) else STATUS_OK
        trailer = TRAILER.pack(TRAILER_MAGIC, after, 0)
        conn.sendall(header + trailer if small else trailer)
        return True

    @staticmethod
    def _error(conn: socket.socket, status: int, message: str) -> None:
        body = message.encode()[:MAX_ERROR_MESSAGE]
        conn.sendall(REPLY.pack(REPLY_MAGIC, VERSION, status, len(body)) + body)

    def drop_connections(self) -> None:
        """Hang up on every client (they reconnect on their next read) and wait for the threads."""
        with self._lock:
            conns = dict(self._conns)
        for sock in conns:
            _hang_up(sock)
        for thread in conns.values():
            if thread.ident is not None:
                thread.join(timeout=5)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() thread
        except OSError:
            pass
        self._listener.close()
        self._accepter.join(timeout=5)
        self.drop_connections()


class TcpTransport(Transport):
    """A private (heap) arena served over TCP at ``host:port``; reads peers' arenas over TCP.

    ``host`` is the interface to bind (tests use 127.0.0.1); ``port=0`` picks a free port.
    ``advertise_host`` is what peers should dial when it differs from ``host`` (binding
    0.0.0.0 in a container); only a direct caller can set it so far: ``make_transport`` and the
    executor's settings do not pass it, so an executor advertises the address it binds. ``token`` is the shared secret every peer must hold (None or
    ``""``: none; the executor passes its ``T2I_DATAPLANE_TOKEN``): it authenticates both the
    clients of our server and the servers we read from. ``max_connections`` caps our server's
    open connections; ``timeout`` bounds every socket operation on both sides and each
    handshake, ``connect_timeout`` (default: ``timeout``) each connect.

    Client connections are pooled per peer and reused (for at most ``timeout / 2`` idle: the
    peer drops silent ones after ``timeout``); a broken pooled connection is retried once on a
    fresh one (reads are idempotent).
    """

    kind = "tcp"

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        capacity: int,
        advertise_host: str | None = None,
        min_block: int = 256,
        token: str | bytes | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._token = resolve_token(token)
        self.arena: HeapArena = HeapArena(capacity, min_block=min_block, name=f"tcp-{host}:{port}")
        slots = slots_for(capacity, min_block)
        self.tags = TagTable(memoryview(bytearray(slots * TAG.size)), slots, name=self.arena.name)
        try:
            self._server = _Server(
                self.arena,
                self.tags,
                host,
                port,
                token=self._token,
                max_connections=max_connections,
                timeout=timeout,
            )
        except OSError:
            self.tags.close()
            self.arena.close()
            raise
        shown = advertise_host or host
        self.address = f"[{shown}]:{self._server.port}" if ":" in shown else f"{shown}:{self._server.port}"
        self.arena.name = self.tags.name = f"tcp-{self.address}"
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._timeout = timeout
        self._idle: defaultdict[str, list[tuple[socket.socket, float]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def authenticated(self) -> bool:
        """Whether connections (ours and our server's) must authenticate with a token."""
        return self._token is not None

    # --- client side ---------------------------------------------------------------------------

    def _checkout(self, address: str) -> tuple[socket.socket, bool]:
        """A connection to ``address``: (socket, reused-from-pool)."""
        expired: list[socket.socket] = []
        reused: socket.socket | None = None
        with self._lock:
            if self._closed:
                raise TransportError(address, "transport is closed")
            idle = self._idle.get(address)
            if idle:
                sock, since = idle.pop()  # the most recently used; the others are older
                if since >= time.monotonic() - self._timeout / 2:
                    reused = sock
                else:  # the peer is about to drop them (or has): do not try them
                    expired = [sock, *(s for s, _ in idle)]
                    idle.clear()
        for sock in expired:
            sock.close()
        if reused is not None:
            return reused, True
        for pause in (*_BUSY_RETRIES, None):
            try:
                return self._connect(address), False
            except PeerBusyError:
                if pause is None:
                    raise
                time.sleep(pause)  # the peer is alive, just full: a burst usually passes quickly
        raise AssertionError("unreachable")

    def _connect(self, address: str) -> socket.socket:
        """A fresh, authenticated connection to ``address``."""
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as exc:
            raise TransportError(address, f"cannot connect: {exc}") from exc
        try:
            sock.settimeout(self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, self._token, address, self._timeout)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError):
                raise TransportError(address, f"handshake failed: {exc}") from exc
            raise
        return sock

    def _checkin(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle[address]
            if not self._closed and len(idle) < _MAX_IDLE_PER_PEER:
                idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _purge(self, address: str) -> None:
        """Close every idle connection to ``address`` (they are likely as stale as the one that broke)."""
        with self._lock:
            idle = self._idle.pop(address, [])
        for sock, _ in idle:
            sock.close()

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """Request ``[offset, offset+nbytes)`` from the peer ``meta.address`` and receive it into ``dst``.

        Raises TransportError when the peer is unreachable, answers with an error (e.g. range
        outside its arena) or sends a malformed reply; AuthenticationError on a token mismatch;
        StaleTensorError when the peer's tag check fails before or after sending.
        """
        out = self._check(meta, dst)
        for attempt in (1, 2):
            sock, reused = self._checkout(meta.address)
            try:
                self._request(sock, meta, out)
            except DataPlaneError:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                # A pooled connection may have been closed by the peer while idle: retry once
                # on a fresh one. A fresh connection failing is a real failure.
                if reused and attempt == 1:
                    self._purge(meta.address)
                    continue
                raise TransportError(meta.address, f"read failed: {exc}") from exc
            self._checkin(meta.address, sock)
            return
        raise AssertionError("unreachable")

    def _request(self, sock: socket.socket, meta: TensorMeta, out: memoryview) -> None:
        key = meta_key(meta) if meta.generation else 0
        sock.sendall(
            REQUEST.pack(
                REQUEST_MAGIC,
                VERSION,
                OP_READ,
                meta.offset,
                meta.nbytes,
                meta.tag_slot,
                0,
                meta.generation,
                key,
            )
        )
        header = bytearray(REPLY.size)
        if not recv_exactly(sock, memoryview(header)):
            raise ConnectionError("peer closed the connection before replying")
        magic, version, status, length = REPLY.unpack(header)
        if magic != REPLY_MAGIC or version != VERSION:
            raise TransportError(meta.address, f"malformed reply header {bytes(header)!r}")
        if status != STATUS_OK:
            if length > MAX_ERROR_MESSAGE:
                raise TransportError(meta.address, f"error reply (status {status}) with oversized message")
            body = bytearray(length)
            if length and not recv_exactly(sock, memoryview(body)):
                raise ConnectionError("peer closed the connection mid-reply")
            message = body.decode(errors="replace")
            if status == STATUS_STALE:
                raise stale(meta, message)
            # The connection is still framed; the caller closes it anyway (errors are rare).
            raise TransportError(meta.address, f"peer refused read (status {status}): {message}")
        if length != meta.nbytes:
            raise TransportError(meta.address, f"peer sent {length} bytes, expected {meta.nbytes}")
        if length and not recv_exactly(sock, out):
            raise ConnectionError("peer closed the connection before sending data")
        magic, after, _ = recv_frame(sock, TRAILER)
        if magic != TRAILER_MAGIC:
            raise TransportError(meta.address, f"malformed reply trailer {bytes(magic)!r}")
        if after == STATUS_STALE:
            raise stale(meta, "the tensor was released while the peer sent it (its tag changed)")
        if after != STATUS_OK:
            raise TransportError(meta.address, f"peer ended the reply with status {after}")

    def close(self) -> None:
        """Stop the server, drop pooled connections, close the arena; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [s for socks in self._idle.values() for s, _ in socks]
            self._idle.clear()
        for sock in idle:
            sock.close()
        self._server.close()
        self.tags.close()
        self.arena.close()
