"""A redis-server configured as a deployment's, for a stack of its own (``Stack(private_redis=True)``).

``deploy/compose.yaml`` runs Redis with the append-only file on and the users in an ACL file
(``redis-server --appendonly yes --aclfile users.acl``). This starts the same on 127.0.0.1 and a
given port, with its data under ``data_dir``, so that a crash and restart of the server
(``Stack.restart_redis``) keeps what a deployment's Redis keeps:

- **Data.** ``appendonly yes`` with ``appendfsync everysec`` (Redis' default, and compose's): every
  write is in the file before its reply is sent, so a crash of the *process* loses no acknowledged
  write; only a crash of the machine can lose the last second. No RDB snapshots (``save ""``).
- **Users.** Users made with ``ACL SETUSER`` live in memory only: after a restart they are gone and
  every service's ``AUTH`` fails. With ``--aclfile`` the server loads them at every start, as
  compose's Redis does. (The append-only file does not record ACL changes.)
- **Transactions in the append-only file.** Redis (7.0.15 here; 7.2 too: redis/redis#14541, fixed
  by #14545; valkey-io/valkey#3983) replays the file as the ``default`` user and checks that user's
  permissions again at each ``EXEC``. A ``MULTI``/``EXEC`` in the file, which is also how a Lua
  script that writes more than once is recorded (the registry's versioning, the scheduler's lease
  and vTime scripts), is refused ("-NOPERM ACLs rules changed between the moment the transaction
  was accumulated and the EXEC call" in the server's log) and silently dropped at start when
  ``default`` may not run those commands: after a restart, a workflow registered before it was
  gone (404 ``model_not_found``). So ``creds.redis_aclfile`` (and so compose, and this server)
  turns ``default`` **off** (no client can authenticate as it, unauthenticated clients get
  ``NOAUTH``, PING included) and gives it every command and key, which only the replay uses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from libs.launcher.brokers import BrokerError, wait_until


def write_aclfile(path: Path, text: str) -> Path:
    """The ACL file (password hashes), readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def server_args(port: int, data_dir: Path, log: Path, aclfile: Path | None = None) -> list[str]:
    """The command line of the server; the same one starts it again after a crash."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise BrokerError("redis-server is not installed (`apt-get install redis-server`)")
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    args = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--logfile",
        str(log),
    ]
    if aclfile is not None:
        args += ["--aclfile", str(aclfile)]
    return args


def answers(url: str) -> bool:
    """Whether the server at ``url`` (with its admin's credentials, if any) answers PING."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False
    finally:
        r.close()


def start(args: list[str], url: str, log: Path, timeout: float = 15.0) -> subprocess.Popen:
    """Start the server and wait until it answers PING as ``url``'s user."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: answers(url), timeout, "redis-server", proc, log)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc
