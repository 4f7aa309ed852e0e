"""Per-role credentials for NATS and Redis, with least-privilege permissions (docs/security.md).

:meth:`Credentials.generate` makes a random password per user of one namespace:

- NATS: ``{ns}-gateway``, ``{ns}-registry``, ``{ns}-scheduler``, ``{ns}-executor`` (and one user per
  executor process whose ids are known in advance, see ``executors``), plus ``{ns}-admin``, the
  operator that creates the streams. :func:`nats_permissions` derives each role's publish/subscribe
  allow lists from ``libs/protocol/subjects.py`` and what the services do with each subject;
  :meth:`Credentials.nats_authorization` renders them as a nats-server ``authorization`` block.
- Redis: ACL users ``{ns}-gateway``, ``{ns}-registry``, ``{ns}-scheduler`` limited to their keys
  and commands (:func:`redis_rules`); ``{ns}-executor`` reaches only the GPU lease keys
  (``{ns}:gpu:*``, libs/common/gpu_lease.py) and nothing else of Redis.

``python -m libs.launcher.creds compose --out DIR`` writes what ``deploy/compose.yaml`` mounts;
``python -m libs.launcher.creds bootstrap`` creates the streams as the admin user.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from libs.common.nats_conn import inbox_prefix
from libs.common.settings import with_userinfo
from libs.protocol.adverts import advertise_subject, adverts_key
from libs.protocol.keys import Keys
from libs.protocol.subjects import Subjects

ROLES = ("gateway", "registry", "scheduler", "executor")
REDIS_ROLES = ("gateway", "registry", "scheduler", "executor")
ADMIN = "admin"

#: Harmless: PING, SELECT (redis-py selects a database other than 0 on connecting) and transactions
#: (each queued command is checked on its own). Not ``client|setinfo``: redis-py ignores its
#: refusal, and Redis < 7.2 refuses an ACL naming it.
#: Redis' ``default`` user in an ACL file: off (no client can use it), allowed everything (the
#: append-only file's replay runs as it; see ``Credentials.redis_aclfile``).
AOF_SAFE_DEFAULT = "user default off resetpass ~* &* +@all"
#: The Redis user of health checks: PING only, so its password is not a secret.
HEALTH_USER = "health"
HEALTH_PASSWORD = "health"

_REDIS_BASE = ("+ping", "+select", "+multi", "+exec", "+discard")
_REDIS_SCRIPTS = ("+evalsha", "+eval", "+script|load")


def nats_permissions(ns: str, role: str, user: str, executor_ids: Sequence[str] = ()) -> dict:
    """The nats-server ``permissions`` map of ``role`` (``user`` names its inbox prefix)."""
    s = Subjects(ns)
    inbox = f"{inbox_prefix(user)}.>"
    intake_info = f"$JS.API.STREAM.INFO.{s.intake_stream}"
    obj = f"OBJ_{s.images_bucket}"
    # The images bucket: look it up, read objects chunk by chunk (ImageBucket: no consumers), write
    # chunks and metadata, purge the chunks an overwrite or a delete leaves behind.
    images = [
        f"$JS.API.STREAM.INFO.{obj}",
        f"$JS.API.STREAM.MSG.GET.{obj}",
        f"$JS.API.STREAM.PURGE.{obj}",
        f"$O.{s.images_bucket}.>",
    ]
    if role == "gateway":
        return {
            "publish": {"allow": [s.intake, s.cancels, s.registry_all, intake_info, *images]},
            "subscribe": {"allow": [s.result("*"), inbox]},
        }
    if role == "registry":  # answers requests (allow_responses), publishes nothing else
        return {
            "publish": {"deny": [">"]},
            "subscribe": {"allow": [f"{s.registry_all} registry"]},
            "allow_responses": True,
        }
    if role == "scheduler":
        stream, durable = s.intake_stream, s.intake_durable
        consumer = [
            f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>",
        ]
        return {
            "publish": {"allow": [s.result("*"), s.executor("*"), s.registry("get"), intake_info, *consumer]},
            "subscribe": {"allow": [s.sched_events, s.cancels, inbox]},
        }
    if role == "executor":
        # A process whose executor ids are known (the launcher's) receives and reports for those
        # only; the generic user (compose: every replica shares it) for any id, so one replica can
        # still claim to be another on the events subjects (docs/security.md, "Limits").
        ids = list(executor_ids) or ["*"]
        own = [s.executor(i) for i in ids] + [s.executor_release(i) for i in ids]
        events = [s.executor_events(i) for i in ids]
        return {
            # Only ReleaseTensors to a producer go executor -> executor: Dispatch, CallbackReady,
            # ReleaseRequest and CancelNode on exec.<id> (and the broadcast exec.all) are the
            # scheduler's.
            # ... and the ModelFns it can run, to the registry (libs/protocol/adverts.py).
            "publish": {"allow": [*events, s.executor_release("*"), *images, advertise_subject(ns)]},
            "subscribe": {"allow": [*own, s.executors_all, inbox]},
            "allow_responses": True,  # the Ack to a Dispatch
        }
    if role == ADMIN:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    raise ValueError(f"unknown role {role!r}; one of {(*ROLES, ADMIN)}")


def redis_rules(ns: str, role: str) -> list[str] | None:
    """The ``ACL SETUSER`` rules of ``role`` (after ``reset on >password``); None: no Redis user."""
    k = Keys(ns)
    extra: list[str] = []
    if role == "gateway":  # request state; the tenant counters read-only (GET /v1/admin/tenants)
        # ... and what its per-tenant limits read: the scheduler's backlog counts, GPU-s per window.
        counters = (k.vtime, k.service, k.ops, k.tenants, k.backlog, k.gpu_window_pattern, k.executors_view)
        keys = [f"~{k.request('*')}", *(f"%R~{x}" for x in counters)]
        cmds = ["+hset", "+hget", "+hmget", "+hgetall", "+expire"]
        # Its own records (services/gateway/records.py: generations, idempotency keys, the recent
        # calls' sorted sets; models.py: workflows' owners): a selector, so these commands reach
        # those keys only.
        # Cancels (services/gateway/bridge.py: flag, then tell the scheduler) and the progress
        # streams it relays, read only.
        extra = [
            f"(~{k.gateway_pattern} +get +mget +set +del +expire +@sortedset)",
            f"(~{k.cancels} +zadd +expire)",
            f"(%R~{k.events('*')} +xread +xrange +xrevrange +xlen)",
        ]
    elif role == "registry":  # specs (versioned by a Lua script) and LoRAs
        # ... and the ModelFns executors advertise (HDEL: the expired ones).
        keys = [f"~{k.workflow('*')}", f"~{k.loras}", f"~{adverts_key(ns)}"]
        cmds = ["+hset", "+hget", "+hgetall", "+hdel", *_REDIS_SCRIPTS]
    elif role == "scheduler":  # request state, tensor metadata, tenant counters (a Lua script)
        lease = (k.scheduler_lease, k.scheduler_epoch)
        own = (k.request("*"), k.tensors("*"), k.vtime, k.ops, k.service, k.tenants, k.backlog)
        keys = [f"~{x}" for x in (*own, k.gpu_window_pattern, *lease)]
        cmds = ["+hset", "+hget", "+hgetall", "+hincrby", "+expire", "+del", *_REDIS_SCRIPTS]
        # The lease and its fencing token (services/scheduler/shell/lease.py: SET NX PX, INCR, GET and
        # PEXPIRE, inside its scripts and the vTime script): a selector, so these commands reach
        # those two keys only.
        # The GPU-second quota window the gateway sets: read only.
        extra = [
            f"({' '.join(f'~{x}' for x in lease)} +set +get +incr +pexpire)",
            f"(%R~{k.quota_window} +get)",
            # Progress streams, the executors view, and the cancels it polls and trims (control.py).
            f"(~{k.events('*')} +xadd +expire +eval)",  # +eval: outbox.py appends a batch in one script
            f"(~{k.executors_view} +hset +hdel +del)",
            f"(~{k.cancels} +zrangebyscore +zrem +zremrangebyscore)",
        ]
    elif role == "executor":  # the GPU lease only: SET NX PX, and its compare-and-act scripts
        keys = [f"~{k.gpu_pattern}"]
        # MGET: a world's watch reads its ranks' leases at once (services/executor/world.py).
        cmds = ["+set", "+get", "+mget", "+pexpire", "+del", *_REDIS_SCRIPTS]
        # An NVSHMEM world's join gate is a hash (libs/dataplane/transport/bootstrap.py): a selector,
        # so the hash commands reach the worlds' keys only.
        extra = [f"(~{k.nvshmem_pattern} +hget +hset +hincrby +pexpire)"]
    elif role == ADMIN:
        return None
    else:
        raise ValueError(f"unknown role {role!r}")
    return ["resetchannels", *keys, "-@all", *cmds, *_REDIS_BASE, *extra]


@dataclass(frozen=True)
class User:
    name: str
    role: str
    password: str
    executor_ids: tuple[str, ...] = ()


@dataclass
class Credentials:
    namespace: str
    nats: dict[str, User] = field(default_factory=dict)  # key: role, or an executor process's name
    redis: dict[str, User] = field(default_factory=dict)  # key: role
    dataplane_token: str = ""  # executors' shared secret for the tcp data plane

    @classmethod
    def generate(cls, namespace: str, executors: Mapping[str, Sequence[str]] | None = None) -> Credentials:
        """Fresh passwords. ``executors`` maps an executor process's name to the executor ids it
        runs: each gets its own NATS user that may subscribe to its own ids only."""

        def user(key: str, role: str, ids: Sequence[str] = ()) -> User:
            return User(f"{namespace}-{key}", role, secrets.token_urlsafe(24), tuple(ids))

        nats = {r: user(r, r) for r in (*ROLES, ADMIN)}
        for name, ids in (executors or {}).items():
            if name in nats:
                raise ValueError(f"executor process name {name!r} collides with a role")
            nats[name] = user(name, "executor", ids)
        return cls(namespace, nats, {r: user(r, r) for r in REDIS_ROLES}, secrets.token_hex(32))

    def nats_user(self, key: str) -> User:
        """The NATS user of a role or executor process (an unknown executor: the generic one)."""
        return self.nats.get(key) or self.nats["executor"]

    # -- NATS -------------------------------------------------------------------------------------
    def nats_authorization(self) -> dict:
        users = [
            {
                "user": u.name,
                "password": u.password,
                "permissions": nats_permissions(self.namespace, u.role, u.name, u.executor_ids),
            }
            for u in self.nats.values()
        ]
        return {"authorization": {"users": users}}

    def nats_config(self, host: str, port: int, store_dir: Path) -> str:
        """A whole nats-server config (JSON is valid nats-server syntax): JetStream and the users."""
        cfg = {"host": host, "port": port, "jetstream": {"store_dir": str(store_dir)}}
        return json.dumps({**cfg, **self.nats_authorization()}, indent=2)

    # -- Redis ------------------------------------------------------------------------------------
    def redis_setuser(self) -> list[list[str]]:
        """One ``ACL SETUSER`` argument list per Redis user."""
        out = []
        for role, u in self.redis.items():
            rules = redis_rules(self.namespace, role)
            assert rules is not None
            out.append([u.name, "reset", "on", f">{u.password}", *rules])
        return out

    def redis_aclfile(self, admin_password: str) -> str:
        """A Redis ``aclfile``: the roles (passwords as SHA-256), an admin, a ``health`` user that
        may only PING (health checks; its password is not a secret), and ``default`` **off**.

        ``default`` is off rather than reduced to PING because Redis replays its append-only file as
        ``default`` and re-checks that user's rights at each ``EXEC`` (redis/redis#14541, fixed
        upstream by #14545, present in 7.0 and 7.2): a ``MULTI``/``EXEC`` — which is also how a Lua
        script that writes twice is logged (the registry's versioning, the lease and vTime scripts)
        — is silently dropped at start when ``default`` may not run it, so a restart lost
        registered workflows. Off, nobody can authenticate as it (unauthenticated clients get
        ``NOAUTH``); all rights, the replay goes through."""
        health = hashlib.sha256(HEALTH_PASSWORD.encode()).hexdigest()
        lines = [AOF_SAFE_DEFAULT, f"user {HEALTH_USER} on #{health} resetchannels resetkeys -@all +ping"]
        admin_hash = hashlib.sha256(admin_password.encode()).hexdigest()
        lines.append(f"user {self.namespace}-{ADMIN} on #{admin_hash} ~* &* +@all")
        for args in self.redis_setuser():
            name, _, _, pw, *rules = args
            digest = hashlib.sha256(pw[1:].encode()).hexdigest()
            lines.append(" ".join(["user", name, "on", f"#{digest}", *rules]))
        return "\n".join(lines) + "\n"

    def create_redis_users(self, redis_url: str) -> None:
        """Create (or reset) the Redis users, connected as ``redis_url``'s (admin) user."""
        import redis

        r = redis.Redis.from_url(redis_url)
        try:
            for args in self.redis_setuser():
                r.execute_command("ACL", "SETUSER", *args)
        finally:
            r.close()

    def delete_redis_users(self, redis_url: str) -> None:
        import redis

        r = redis.Redis.from_url(redis_url)
        try:
            r.execute_command("ACL", "DELUSER", *(u.name for u in self.redis.values()))
        finally:
            r.close()

    # -- what a process gets --------------------------------------------------------------------------
    def env(self, key: str, role: str) -> dict[str, str]:
        """The credential variables of one process: its NATS user, and its role's Redis user."""
        u = self.nats_user(key)
        env = {"T2I_NATS_USER": u.name, "T2I_NATS_PASSWORD": u.password}
        if role in self.redis:
            env |= {"T2I_REDIS_USER": self.redis[role].name, "T2I_REDIS_PASSWORD": self.redis[role].password}
        if role == "executor" and self.dataplane_token:
            env["T2I_DATAPLANE_TOKEN"] = self.dataplane_token
        return env

    def nats_url(self, url: str, key: str) -> str:
        u = self.nats_user(key)
        return with_userinfo(url, u.name, u.password)

    def redis_url(self, url: str, role: str) -> str:
        u = self.redis[role]
        return with_userinfo(url, u.name, u.password)


# -- deploy/compose.yaml ------------------------------------------------------------------------------
def write_compose(out: Path, namespace: str) -> bool:
    """The files compose mounts, one volume each: ``nats/auth.conf`` (nats-server), ``redis/users.acl``
    (redis-server), ``admin/`` (the bootstrap), and ``<role>/{nats,redis}_password`` (each service sees
    its own only). Kept when all are there for this namespace (a restart keeps its credentials);
    returns whether it wrote."""
    creds = Credentials.generate(namespace)
    admin_redis = secrets.token_urlsafe(24)
    files = {
        "nats/auth.conf": json.dumps(creds.nats_authorization(), indent=2),
        "redis/users.acl": creds.redis_aclfile(admin_redis),
        "admin/nats_password": creds.nats[ADMIN].password,
        "admin/redis_password": admin_redis,
    }
    files["executor/dataplane_token"] = creds.dataplane_token
    for role in ROLES:
        files[f"{role}/nats_password"] = creds.nats[role].password
        if role in creds.redis:
            files[f"{role}/redis_password"] = creds.redis[role].password
    if all((out / rel).exists() for rel in files) and _users(out / "nats" / "auth.conf") == {
        u.name for u in creds.nats.values()
    }:
        return False
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        tmp.write_text(text)
        # Readable by the service's uid (the control image runs as nobody): each volume is mounted
        # into its one service only.
        tmp.chmod(0o444)
        tmp.replace(path)
    return True


def _users(auth_conf: Path) -> set[str]:
    try:
        return {u["user"] for u in json.loads(auth_conf.read_text())["authorization"]["users"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


async def bootstrap(nats_url: str, namespace: str, wait_s: float = 30.0) -> None:
    """Create the intake stream and the images bucket as the admin user (``nats_url`` names it)."""
    import asyncio
    import time

    import nats

    from libs.common.jetstream import ensure_all
    from libs.common.nats_conn import split_credentials

    server, user, password = split_credentials(nats_url)
    deadline = time.monotonic() + wait_s

    async def quiet(e: Exception) -> None:  # a refused connect while the server starts: retried here
        pass

    while True:
        try:
            nc = await nats.connect(
                server,
                name="t2i-bootstrap",
                user=user or None,
                password=password or None,
                allow_reconnect=False,
                error_cb=quiet,
            )
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    try:
        await ensure_all(nc.jetstream(), Subjects(namespace))
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m libs.launcher.creds", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compose", help="write the credential files deploy/compose.yaml mounts")
    c.add_argument("--out", type=Path, required=True)
    sub.add_parser("bootstrap", help="create the streams as the admin user (T2I_NATS_* settings)")
    args = ap.parse_args(argv)
    from libs.common.settings import common_settings

    if args.cmd == "compose":
        namespace = common_settings().namespace  # T2I_NAMESPACE, checked as every service checks it
        wrote = write_compose(args.out, namespace)
        print(f"{'wrote' if wrote else 'kept'} credentials for namespace {namespace} in {args.out}")
        return 0
    import asyncio

    s = common_settings()
    asyncio.run(bootstrap(s.nats_url, s.namespace))
    print(f"created the streams of namespace {s.namespace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
