"""Running the whole platform on one machine as separate processes (no Docker).

:class:`Stack` starts the registry, scheduler, gateway and N executors, each ``python -m
services.<name>`` with its own environment, logs to files, waits until the gateway is ready and
every executor has said so, and stops everything it started. ``make run`` and the end-to-end tests
use it; a deployment uses ``deploy/compose.yaml`` instead.

``secure=True`` (``make run``'s default) runs the platform with credentials (docs/security.md): a
private nats-server on a free port whose users are the roles (``creds.Credentials``), its streams
created by the admin user, and Redis ACL users per role created on ``redis_url`` (connected as its
user: an admin) and deleted on stop. Each process gets only its own role's credentials.

``private_redis=True`` runs the stack's own redis-server on a free port instead of using
``redis_url`` (which then names it), configured as a deployment's Redis (``deploy/compose.yaml``):
append-only file on (``appendfsync everysec``), and with ``secure`` the roles' users in an ACL file
(``--aclfile``) with an admin user in the URL and ``default`` turned off (compose reduces it to
PING, which makes Redis drop the file's transactions on a restart: ``private_redis.py``). Users and
data therefore survive :meth:`Stack.restart_redis`, a crash and restart of that server (tests of a
Redis outage). Its directory (data, ACL file) is removed on stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from libs.common.nats_conn import split_credentials
from libs.common.settings import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, redact, with_userinfo
from libs.dataplane.hosttier import HostTier
from libs.launcher import brokers
from libs.launcher import private_redis as redis_server
from libs.launcher.creds import ADMIN, Credentials, bootstrap


class StackError(RuntimeError):
    pass


@dataclass
class Stack:
    namespace: str
    log_dir: Path
    model_root: Path
    gateway_port: int = 8000
    executors: int = 2
    api_keys: str = "sk-t2i-dev=local:admin"
    nats_url: str = DEFAULT_NATS_URL
    redis_url: str = DEFAULT_REDIS_URL
    executor_threads: int = 1
    executor_arena_mb: int = 256
    sim_executors: int = 0  # simulated executors, in ``sim_processes`` extra processes
    sim_processes: int = 1  # 2+: "sim-executors-0", ... each running its share (ids ``{ns}-sim{p}-{i}``)
    sim_heartbeat_s: float = 0.5
    sim_profile: str = "paper-h800"
    sim_time_scale: float = 1.0
    schedulers: int = 1  # 2+: scheduler-0, scheduler-1, ... (one leads: the lease decides)
    scheduler_env: dict[str, str] = field(default_factory=dict)
    gateway_env: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    secure: bool = False  # private nats-server and Redis ACL users, one per role (see above)
    private_redis: bool = False  # its own redis-server (AOF, ACL file): sets redis_url (see above)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    credentials: Credentials | None = None  # secure: every user's credentials (tests use them)
    bus_url: str = ""  # secure: the private nats-server's URL (no credentials in it)
    # The executors' shared secret for the tcp data plane (secure stacks: the credentials' own).
    dataplane_token: str = field(default_factory=lambda: secrets.token_hex(32))
    _nats: subprocess.Popen | None = None
    _redis: subprocess.Popen | None = None
    _redis_args: list[str] = field(default_factory=list)  # for restart_redis()
    _spawned: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)  # for restart()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def env(self, **more: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("T2I_")}
        env.update(
            T2I_NAMESPACE=self.namespace,
            T2I_NATS_URL=self.bus_url or self.nats_url,
            # Secure: no process inherits the admin's Redis credentials, only its role's (spawn).
            T2I_REDIS_URL=split_credentials(self.redis_url)[0] if self.secure else self.redis_url,
            PYTHONUNBUFFERED="1",
            **self.extra_env,
            **more,
        )
        return env

    def spawn(self, name: str, module: str, **env: str) -> subprocess.Popen:
        if self.credentials is not None:
            role = module.rsplit(".", 1)[-1]
            env = {**self.credentials.env(name if role == "executor" else role, role), **env}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=self.env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )
        out.close()
        self.procs[name] = proc
        self._spawned[name] = (module, dict(env))
        return proc

    def start_executor(self, name: str) -> subprocess.Popen:
        return self.spawn(
            name,
            "services.executor",
            T2I_EXECUTOR_ID=f"{self.namespace}-{name}",
            T2I_EXECUTOR_THREADS=str(self.executor_threads),
            T2I_EXECUTOR_ARENA_MB=str(self.executor_arena_mb),
            T2I_EXECUTOR_MODEL_ROOT=str(self.model_root),
            T2I_EXECUTOR_HEARTBEAT_S="0.5",
            T2I_DATAPLANE_TOKEN=self.credentials.dataplane_token
            if self.credentials
            else self.dataplane_token,
        )

    def start_scheduler(self) -> subprocess.Popen:
        """One scheduler ("scheduler"), or ``schedulers`` of them ("scheduler-0", ...): the first
        to take the lease leads, the others wait as standbys. Returns the last one started."""
        env = {"T2I_SCHEDULER_HEARTBEAT_TIMEOUT_S": "3", **self.scheduler_env}
        names = ["scheduler"] if self.schedulers <= 1 else [f"scheduler-{i}" for i in range(self.schedulers)]
        for name in names:
            proc = self.spawn(name, "services.scheduler", **env)
        return proc

    def start(self, timeout: float = 120.0) -> Stack:
        try:
            if self.secure:
                self.start_secure_brokers()
            elif self.private_redis:
                self.start_private_redis()
            self.spawn("registry", "services.registry")
            self.start_scheduler()
            self.spawn(
                "gateway",
                "services.gateway",
                T2I_GATEWAY_PORT=str(self.gateway_port),
                T2I_GATEWAY_API_KEYS=self.api_keys,
                **self.gateway_env,
            )
            for i in range(self.executors):
                self.start_executor(f"executor-{i}")
            for name, base, count in self._sim_groups():
                self.spawn(
                    name,
                    "services.executor",
                    T2I_EXECUTOR_MODE="sim",
                    T2I_EXECUTOR_ID=base,
                    T2I_EXECUTOR_SIM_COUNT=str(count),
                    T2I_EXECUTOR_SIM_PROFILE=self.sim_profile,
                    T2I_EXECUTOR_SIM_TIME_SCALE=str(self.sim_time_scale),
                    T2I_EXECUTOR_HEARTBEAT_S=str(self.sim_heartbeat_s),
                )
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def executor_ids(self) -> dict[str, list[str]]:
        """Executor process name -> the executor ids it runs (as ``start`` names them)."""
        ids = {f"executor-{i}": [f"{self.namespace}-executor-{i}"] for i in range(self.executors)}
        for name, base, n in self._sim_groups():
            ids[name] = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
        return ids

    def _sim_groups(self) -> list[tuple[str, str, int]]:
        """(process name, executor id base, count) per simulated-executor process."""
        if self.sim_executors <= 0:
            return []
        procs = max(1, min(self.sim_processes, self.sim_executors))
        if procs == 1:
            return [("sim-executors", f"{self.namespace}-sim", self.sim_executors)]
        share, extra = divmod(self.sim_executors, procs)
        return [
            (f"sim-executors-{p}", f"{self.namespace}-sim{p}", share + (1 if p < extra else 0))
            for p in range(procs)
        ]

    def start_secure_brokers(self) -> None:
        """The private nats-server with the roles' users and the streams, and the Redis users."""
        creds = Credentials.generate(self.namespace, self.executor_ids())
        self.credentials = creds  # from here on stop() cleans up
        workdir = self.log_dir / "nats"
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        port = brokers.free_port()
        conf = workdir / "nats.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(creds.nats_config("127.0.0.1", port, workdir / "jetstream"))
        self._nats = brokers.start_nats(port, workdir, config=conf)
        self.bus_url = f"nats://127.0.0.1:{port}"
        asyncio.run(bootstrap(creds.nats_url(self.bus_url, ADMIN), self.namespace, wait_s=10))
        if self.private_redis:  # the users go into its ACL file: they survive a restart
            self.start_private_redis(creds)
            return
        try:
            creds.create_redis_users(self.redis_url)
        except Exception as e:
            raise StackError(
                f"creating the Redis users on {redact(self.redis_url)} failed ({e}); its user needs "
                "the ACL command (the default user has it), or run without credentials"
            ) from e

    def restart_nats(self, down_s: float = 1.0) -> float:
        """Kill the private nats-server (SIGKILL: a crash), keep it down ``down_s`` seconds, and start
        it again on the same port with the same config and JetStream store (tests of a bus outage).
        Returns the seconds the bus was unreachable. Only a ``secure`` stack runs its own server."""
        if self._nats is None or not self.bus_url:
            raise StackError("only a secure stack runs its own nats-server")
        t0 = time.monotonic()
        self._nats.kill()
        self._nats.wait(10)
        time.sleep(down_s)
        workdir = self.log_dir / "nats"
        log = workdir / "nats-server.log"
        if log.exists():  # start_nats waits for "Server is ready" in a fresh log
            log.rename(workdir / f"nats-server.{int(time.time() * 1000)}.log")
        port = int(self.bus_url.rsplit(":", 1)[1])
        self._nats = brokers.start_nats(port, workdir, config=workdir / "nats.conf")
        return time.monotonic() - t0

    def start_private_redis(self, creds: Credentials | None = None) -> None:
        """The stack's own redis-server (``private_redis``); ``creds``: with the roles' ACL users."""
        workdir, port = self.log_dir / "redis", brokers.free_port()
        url, aclfile = f"redis://127.0.0.1:{port}/0", None
        if creds is not None:  # the roles, an admin (the stack's own URL), default off
            password = secrets.token_urlsafe(24)
            text = creds.redis_aclfile(password)
            aclfile = redis_server.write_aclfile(workdir / "data" / "users.acl", text)
            url = with_userinfo(url, f"{self.namespace}-{ADMIN}", password)
        self._redis_args = redis_server.server_args(port, workdir / "data", workdir / "redis.log", aclfile)
        self._redis = redis_server.start(self._redis_args, url, workdir / "redis.log")
        self.redis_url = url

    def restart_redis(self, down_s: float = 1.0) -> float:
        """Kill the private redis-server (SIGKILL: a crash), keep it down ``down_s`` seconds, and start
        it again on the same port with the same config, append-only file and ACL file (tests of a
        Redis outage). Returns the seconds Redis was unreachable. Only a ``private_redis`` stack
        runs its own server."""
        if self._redis is None:
            raise StackError("only a private_redis stack runs its own redis-server")
        t0 = time.monotonic()
        self._redis.kill()
        self._redis.wait(10)
        time.sleep(down_s)
        self._redis = redis_server.start(
            self._redis_args, self.redis_url, self.log_dir / "redis" / "redis.log"
        )
        return time.monotonic() - t0

    def stop_private_redis(self) -> None:
        if self._redis is not None:
            brokers.stop([self._redis])
            self._redis = None
        shutil.rmtree(self.log_dir / "redis" / "data", ignore_errors=True)  # the data, the ACL file

    def stop_secure_brokers(self) -> None:
        if self.credentials is not None and not self.private_redis:
            try:
                self.credentials.delete_redis_users(self.redis_url)
            except Exception as e:  # noqa: BLE001 - Redis gone: its users went with it
                print(f"could not delete the Redis users of {self.namespace}: {e}", file=sys.stderr)
        if self._nats is not None:
            brokers.stop([self._nats])
            self._nats = None
        workdir = self.log_dir / "nats"
        (workdir / "nats.conf").unlink(missing_ok=True)  # the passwords
        shutil.rmtree(workdir / "jetstream", ignore_errors=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {n for n in self.procs if n.startswith("executor")} | {"gateway"}
        while pending and time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise StackError(f"{name} exited with {proc.returncode}\n{self.tail(name)}")
            for name in list(pending):
                if name == "gateway":
                    if self.http("GET", "/readyz")[0] == 200:
                        pending.discard(name)
                elif "executor ready" in self.read_log(name):
                    pending.discard(name)
            time.sleep(0.1)
        if pending:
            raise StackError(
                f"not ready after {timeout:.0f}s: {sorted(pending)}\n"
                + "\n".join(self.tail(n) for n in pending)
            )

    def http(
        self, method: str, path: str, body: object = None, key: str | None = None, timeout: float = 300.0
    ) -> tuple[int, dict]:
        """A JSON call to the gateway; returns (status, body). Never raises on HTTP errors."""
        key = key or self.api_keys.split(",")[0].split("=")[0]
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"{}")
            except json.JSONDecodeError:
                return e.code, {"raw": raw.decode(errors="replace")}
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, {}

    def read_log(self, name: str) -> str:
        p = self.log_dir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def tail(self, name: str, chars: int = 3000) -> str:
        return f"--- {name} log ---\n{self.read_log(name)[-chars:]}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(10)

    def restart(self, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """Kill the process ``name`` (SIGKILL: a crash) if it still runs, and start it again with the
        same module and environment (tests of a crash). Its log goes on in the same file."""
        module, env = self._spawned[name]
        if self.procs[name].poll() is None:
            self.kill(name, sig)
        return self.spawn(name, module, **env)

    def stop(self, timeout: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The executors' shared host tier belongs to this stack's namespace: nobody else uses it.
        HostTier.destroy(f"{self.namespace}-host")
        if self.secure:
            self.stop_secure_brokers()
        if self.private_redis:
            self.stop_private_redis()
