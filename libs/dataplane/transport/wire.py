"""The TCP transport's wire protocol (version 2): frames, the token handshake, framed socket I/O.

Fixed binary frames, network byte order:

    server hello = "T2IH" | version u16 | status u16 | flags u32 (1 = token) | nonce 32B   (44 bytes)
    client auth  = "T2IK" | version u16 | 0 u16      | nonce 32B | mac 32B                 (72 bytes)
    auth reply   = "T2IO" | version u16 | status u16 | proof 32B                           (40 bytes)
    request      = "T2IR" | version u16 | op u16 (1 = read) | offset u64 | nbytes u64
                   | tag slot u32 | 0 u32 | generation u64 | key u64                       (48 bytes)
    reply        = "T2IA" | version u16 | status u16 | length u64                          (16 bytes)
                   then ``length`` bytes: the data (status 0) or a UTF-8 error message;
                   after data, a trailer "T2IE" | status u16 | 0 u16                      (8 bytes)

The server speaks first (hello: busy or not, token or not, a nonce). With a token the client
answers ``mac = HMAC-SHA256(token, "t2i-dataplane-v2 client" | server nonce | client nonce)`` and
the server proves itself with the same HMAC over "server"; without one both MACs are zero. Only
then are requests served. ``tcp.py`` holds the server and the client transport.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import time
from hashlib import sha256

from libs.dataplane.errors import AuthenticationError, PeerBusyError, TransportError

TOKEN_ENV = "T2I_DATAPLANE_TOKEN"  # the setting's name, for messages (the executor reads it)
DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 64

HELLO = struct.Struct("!4sHHI32s")
AUTH = struct.Struct("!4sHH32s32s")
AUTH_REPLY = struct.Struct("!4sHH32s")
REQUEST = struct.Struct("!4sHHQQIIQQ")
REPLY = struct.Struct("!4sHHQ")
TRAILER = struct.Struct("!4sHH")
HELLO_MAGIC = b"T2IH"
AUTH_MAGIC = b"T2IK"
AUTH_REPLY_MAGIC = b"T2IO"
REQUEST_MAGIC = b"T2IR"
REPLY_MAGIC = b"T2IA"
TRAILER_MAGIC = b"T2IE"
VERSION = 2
OP_READ = 1
FLAG_TOKEN = 1

STATUS_OK = 0
STATUS_BAD_REQUEST = 1
STATUS_OUT_OF_RANGE = 2
STATUS_UNAVAILABLE = 3
STATUS_STALE = 4
STATUS_BUSY = 5
STATUS_AUTH_FAILED = 6

MAX_ERROR_MESSAGE = 64 << 10
NO_MAC = bytes(32)


def resolve_token(token: str | bytes | None) -> bytes | None:
    """``token`` as the handshake uses it: bytes, or None for no authentication (``""`` or None).
    Where it comes from is the caller's setting (the executor's ``T2I_DATAPLANE_TOKEN``)."""
    if isinstance(token, str):
        token = token.encode()
    return token or None


def handshake_mac(token: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, b"t2i-dataplane-v2 " + role + server_nonce + client_nonce, sha256).digest()


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6addr]:port"``); raises TransportError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransportError(address, "address must be 'host:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed before the first byte, else raises.

    Each recv is bounded by the socket's timeout; with ``deadline`` (time.monotonic) the whole
    call is bounded too (a peer trickling one byte per timeout cannot hold it open).
    """
    got = 0
    n = view.nbytes
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {got} of {n} bytes")
            sock.settimeout(remaining)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return True


def recv_frame(sock: socket.socket, frame: struct.Struct, deadline: float | None = None) -> tuple:
    buf = bytearray(frame.size)
    if not recv_exactly(sock, memoryview(buf), deadline):
        raise ConnectionError("peer closed the connection")
    return frame.unpack(buf)


def client_handshake(sock: socket.socket, token: bytes | None, address: str, timeout: float) -> None:
    """Our side of the handshake on a fresh connection (within ``timeout`` seconds in all).

    TransportError if the peer is busy or not a data-plane server; AuthenticationError (not
    retryable) if exactly one side has a token, the peer rejects ours, or cannot prove it holds it.
    """
    deadline = time.monotonic() + timeout
    magic, version, status, flags, server_nonce = recv_frame(sock, HELLO, deadline)
    if magic != HELLO_MAGIC:
        raise TransportError(address, f"not a data-plane server (hello {bytes(magic)!r})")
    if version != VERSION:
        raise TransportError(address, f"peer speaks protocol version {version}, we speak {VERSION}")
    if status == STATUS_BUSY:
        raise PeerBusyError(address)
    if status != STATUS_OK:
        raise TransportError(address, f"peer refused the connection (status {status})")
    if flags & FLAG_TOKEN and token is None:
        raise AuthenticationError(address, f"peer requires a token and none is configured (${TOKEN_ENV})")
    if token is not None and not flags & FLAG_TOKEN:
        raise AuthenticationError(address, "a token is configured but the peer does not authenticate")
    client_nonce = os.urandom(32)
    mac = handshake_mac(token, b"client", server_nonce, client_nonce) if token else NO_MAC
    sock.sendall(AUTH.pack(AUTH_MAGIC, VERSION, 0, client_nonce, mac))
    magic, version, status, proof = recv_frame(sock, AUTH_REPLY, deadline)
    sock.settimeout(timeout)
    if magic != AUTH_REPLY_MAGIC or version != VERSION:
        raise TransportError(address, f"malformed handshake reply {bytes(magic)!r} v{version}")
    if status == STATUS_AUTH_FAILED:
        raise AuthenticationError(address, "peer rejected our token")
    if status != STATUS_OK:
        raise TransportError(address, f"peer refused the handshake (status {status})")
    if token is not None and not hmac.compare_digest(
        proof, handshake_mac(token, b"server", server_nonce, client_nonce)
    ):
        raise AuthenticationError(address, "peer could not prove it holds the token")
