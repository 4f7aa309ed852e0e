"""TCP transport: pull tensors from executors on other hosts or in other containers.

There is no remote memory access over plain TCP, so each executor runs a small threaded server
that answers "read ``nbytes`` at ``offset``" from its arena; the executor's own code is not
involved (the server threads read the arena as a shared-memory peer would). Framing is a fixed
binary header (network byte order):

    request  = magic "T2IR" | version u16 | op u16 (1 = read) | offset u64 | nbytes u64   (24 bytes)
    reply    = magic "T2IA" | version u16 | status u16        | length u64                 (16 bytes)
               then ``length`` bytes: the data (status 0) or a UTF-8 error message.

Every header is validated on both sides. A malformed request gets an error reply, never a crash;
a bad magic closes the connection (the stream can no longer be trusted to be framed).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections import defaultdict

from libs.dataplane.arena import HeapArena
from libs.dataplane.errors import DataPlaneError, TransportError
from libs.dataplane.transport.base import Transport
from libs.protocol.tensor_meta import TensorMeta

log = logging.getLogger(__name__)

REQUEST = struct.Struct("!4sHHQQ")
REPLY = struct.Struct("!4sHHQ")
REQUEST_MAGIC = b"T2IR"
REPLY_MAGIC = b"T2IA"
VERSION = 1
OP_READ = 1

STATUS_OK = 0
STATUS_BAD_REQUEST = 1
STATUS_OUT_OF_RANGE = 2
STATUS_UNAVAILABLE = 3

_MAX_ERROR_MESSAGE = 64 << 10
_MAX_IDLE_PER_PEER = 4


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6addr]:port"``); raises TransportError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransportError(address, "address must be 'host:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed before the first byte, else raises."""
    got = 0
    n = view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


class _Server:
    """Accepts connections and answers read requests from ``arena`` with one thread per connection."""

    def __init__(self, arena: HeapArena, host: str, port: int) -> None:
        self._arena = arena
        self._listener = socket.create_server((host, port), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"t2i-tcp-accept-{self.port}", daemon=True
        )
        self._accepter.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn,), name=f"t2i-tcp-{peer}", daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(REQUEST.size)
        try:
            while _recv_exactly(conn, memoryview(header)):
                if not self._answer(conn, header):
                    break
        except OSError:
            pass  # client went away mid-request; nothing to answer
        except Exception:  # a bug must not kill the server, only this connection
            log.exception("tcp transport: error while serving a read")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, header: bytearray) -> bool:
        """Answer one request; False when the connection must be closed."""
        magic, version, op, offset, nbytes = REQUEST.unpack(header)
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
        try:
            data = self._arena.view(offset, nbytes)
        except (DataPlaneError, ValueError) as exc:
            self._error(conn, STATUS_UNAVAILABLE, str(exc))
            return True
        with data:
            conn.sendall(REPLY.pack(REPLY_MAGIC, VERSION, STATUS_OK, nbytes))
            if nbytes:
                conn.sendall(data)
        return True

    @staticmethod
    def _error(conn: socket.socket, status: int, message: str) -> None:
        body = message.encode()[:_MAX_ERROR_MESSAGE]
        conn.sendall(REPLY.pack(REPLY_MAGIC, VERSION, status, len(body)) + body)

    def drop_connections(self) -> None:
        """Hang up on every client (they reconnect on their next read) and wait for the threads."""
        with self._lock:
            conns = dict(self._conns)
        # shutdown() (not just close()) is what wakes a thread blocked in recv() on Linux.
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in conns.values():
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
    0.0.0.0 in a container). Client connections are pooled per peer and reused; a broken pooled
    connection is retried once on a fresh one (reads are idempotent).
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
        connect_timeout: float = 10.0,
        io_timeout: float = 60.0,
    ) -> None:
        self.arena: HeapArena = HeapArena(capacity, min_block=min_block, name=f"tcp-{host}:{port}")
        try:
            self._server = _Server(self.arena, host, port)
        except OSError:
            self.arena.close()
            raise
        shown = advertise_host or host
        self.address = f"[{shown}]:{self._server.port}" if ":" in shown else f"{shown}:{self._server.port}"
        self.arena.name = f"tcp-{self.address}"
        self._connect_timeout = connect_timeout
        self._io_timeout = io_timeout
        self._idle: defaultdict[str, list[socket.socket]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def port(self) -> int:
        return self._server.port

    # --- client side ---------------------------------------------------------------------------

    def _checkout(self, address: str) -> tuple[socket.socket, bool]:
        """A connection to ``address``: (socket, reused-from-pool)."""
        with self._lock:
            if self._closed:
                raise TransportError(address, "transport is closed")
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as exc:
            raise TransportError(address, f"cannot connect: {exc}") from exc
        sock.settimeout(self._io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _checkin(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle[address]
            if not self._closed and len(idle) < _MAX_IDLE_PER_PEER:
                idle.append(sock)
                return
        sock.close()

    def _purge(self, address: str) -> None:
        """Close every idle connection to ``address`` (they are likely as stale as the one that broke)."""
        with self._lock:
            idle = self._idle.pop(address, [])
        for sock in idle:
            sock.close()

    def read(self, meta: TensorMeta, dst: memoryview) -> None:
        """Request ``[offset, offset+nbytes)`` from the peer ``meta.address`` and receive it into ``dst``.

        Raises TransportError when the peer is unreachable, answers with an error (e.g. range
        outside its arena) or sends a malformed reply.
        """
        out = self._check(meta, dst)
        for attempt in (1, 2):
            sock, reused = self._checkout(meta.address)
            try:
                self._request(sock, meta, out)
            except TransportError:
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
        sock.sendall(REQUEST.pack(REQUEST_MAGIC, VERSION, OP_READ, meta.offset, meta.nbytes))
        header = bytearray(REPLY.size)
        if not _recv_exactly(sock, memoryview(header)):
            raise ConnectionError("peer closed the connection before replying")
        magic, version, status, length = REPLY.unpack(header)
        if magic != REPLY_MAGIC or version != VERSION:
            raise TransportError(meta.address, f"malformed reply header {bytes(header)!r}")
        if status != STATUS_OK:
            if length > _MAX_ERROR_MESSAGE:
                raise TransportError(meta.address, f"error reply (status {status}) with oversized message")
            body = bytearray(length)
            if length and not _recv_exactly(sock, memoryview(body)):
                raise ConnectionError("peer closed the connection mid-reply")
            # The connection is still framed; the caller closes it anyway (errors are rare).
            raise TransportError(
                meta.address, f"peer refused read (status {status}): {body.decode(errors='replace')}"
            )
        if length != meta.nbytes:
            raise TransportError(meta.address, f"peer sent {length} bytes, expected {meta.nbytes}")
        if length and not _recv_exactly(sock, out):
            raise ConnectionError("peer closed the connection before sending data")

    def close(self) -> None:
        """Stop the server, drop pooled connections, close the arena; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [s for socks in self._idle.values() for s in socks]
            self._idle.clear()
        for sock in idle:
            sock.close()
        self._server.close()
        self.arena.close()
