"""How long the TCP transport's time limits take to act, against baselines from the same run.

The tests (``tests/unit/test_dataplane_integrity.py``) check *why* a wait ends — the configured
timeout, the handshake's deadline, the busy back-off schedule — never how long it took; the
figures are here. Each rep measures a baseline and then the transport, interleaved, so drift in
the machine's load hits both alike; a ratio is the median of the per-rep ratios:

* ``mute_read``: a read from a server that accepts and never answers, until it fails; baseline: a
  bare socket's ``recv`` with the same timeout on such a server (what the OS alone takes);
* ``silent_drop``: a client that connects and sends nothing, until the server hangs up; same baseline;
* ``trickle_drop``: a client sending its handshake a byte every third of the timeout (each byte
  alone in time), until the server hangs up; same baseline (the handshake's deadline is one timeout);
* ``busy_backoff``: a read from a server at its connection cap, until it gives up; baseline: the
  back-off schedule's pauses slept back to back.

A ratio near 1 means the limit acts when configured; well above 1, something waits longer.
Writes ``bench/results/tcp_timeouts.json``.

    .venv/bin/python bench/tcp_timeouts.py [--timeout-s 0.3] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import libs.dataplane.transport.tcp as tcp_module
from libs.dataplane.errors import PeerBusyError, TransportError
from libs.dataplane.transport import TcpTransport
from libs.dataplane.transport.wire import AUTH, HELLO
from libs.protocol.tensor_meta import TensorMeta

KIB = 1024
BOUND = 30.0  # no wait here may take longer: something is broken then


def _meta(port: int) -> TensorMeta:
    return TensorMeta("bench/x", "producer", "tcp", f"127.0.0.1:{port}", 0, 4, "uint8", [4])


def bare_recv_timeout(timeout: float) -> float:
    """A plain socket's recv timing out on a server that never sends (the OS's own timeout)."""
    with socket.create_server(("127.0.0.1", 0)) as mute:
        with socket.create_connection(mute.getsockname(), timeout=BOUND) as sock:
            sock.settimeout(timeout)
            start = time.perf_counter()
            try:
                sock.recv(1)
            except TimeoutError:
                return time.perf_counter() - start
    raise RuntimeError("the mute server sent something")


def mute_read(timeout: float) -> float:
    with (
        socket.create_server(("127.0.0.1", 0)) as mute,
        TcpTransport("127.0.0.1", capacity=64 * KIB, timeout=timeout) as ours,
    ):
        start = time.perf_counter()
        try:
            ours.read(_meta(mute.getsockname()[1]), memoryview(bytearray(4)))
        except TransportError:
            return time.perf_counter() - start
    raise RuntimeError("a read from a mute server succeeded")


def silent_drop(peer: TcpTransport) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as silent:
        silent.recv(HELLO.size, socket.MSG_WAITALL)
        if silent.recv(1) != b"":
            raise RuntimeError("the server sent more than its hello")
        return time.perf_counter() - start


def trickle_drop(peer: TcpTransport, timeout: float) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", peer.port), timeout=BOUND) as trickler:
        trickler.recv(HELLO.size, socket.MSG_WAITALL)
        for _ in range(AUTH.size - 1):
            try:
                trickler.sendall(b"T")
                readable, _, _ = select.select([trickler], [], [], timeout / 3)
                if readable and trickler.recv(1) == b"":
                    return time.perf_counter() - start
            except OSError:
                return time.perf_counter() - start
    raise RuntimeError("a trickling client held the handshake open")


def slept_schedule() -> float:
    start = time.perf_counter()
    for pause in tcp_module._BUSY_RETRIES:  # noqa: SLF001
        time.sleep(pause)
    return time.perf_counter() - start


def busy_backoff(peer: TcpTransport, ours: TcpTransport) -> float:
    start = time.perf_counter()
    try:
        ours.read(_meta(peer.port), memoryview(bytearray(4)))
    except PeerBusyError:
        return time.perf_counter() - start
    raise RuntimeError("a read from a full server succeeded")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--timeout-s", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    logging.getLogger(tcp_module.__name__).setLevel(logging.ERROR)  # each refusal is the point here
    t = args.timeout_s
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in ("mute_read", "silent_drop", "trickle_drop")}
    runs["busy_backoff"] = []
    with TcpTransport("127.0.0.1", capacity=64 * KIB, timeout=t) as peer:
        for _ in range(args.reps):
            runs["mute_read"].append((bare_recv_timeout(t), mute_read(t)))
            runs["silent_drop"].append((bare_recv_timeout(t), silent_drop(peer)))
            runs["trickle_drop"].append((bare_recv_timeout(t), trickle_drop(peer, t)))
    with (
        TcpTransport("127.0.0.1", capacity=64 * KIB, max_connections=1) as full,
        TcpTransport("127.0.0.1", capacity=64 * KIB) as ours,
    ):
        with socket.create_connection(("127.0.0.1", full.port), timeout=BOUND) as held:
            held.recv(HELLO.size, socket.MSG_WAITALL)  # handshaking: it holds the one place
            for _ in range(args.reps):
                runs["busy_backoff"].append((slept_schedule(), busy_backoff(full, ours)))
    print(f"timeout {t:g} s, busy pauses {list(tcp_module._BUSY_RETRIES)} s; median of {args.reps} reps")  # noqa: SLF001
    print(f"{'figure':>13} {'seconds':>8} {'baseline':>9} {'ratio':>6}")
    out: dict[str, dict[str, float]] = {}
    for name, pairs in runs.items():
        base = statistics.median(b for b, _ in pairs)
        took = statistics.median(x for _, x in pairs)
        ratio = statistics.median(x / b for b, x in pairs)
        out[name] = {"seconds": took, "baseline_s": base, "ratio": ratio}
        print(f"{name:>13} {took:>8.3f} {base:>9.3f} {ratio:>6.2f}")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "tcp_timeouts.json").write_text(
        json.dumps({"timeout_s": t, "reps": args.reps, "figures": out}, indent=1)
    )


if __name__ == "__main__":
    main()
