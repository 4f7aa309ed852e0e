"""Credentials on the bus and in Redis (docs/security.md).

A secured stack (its own nats-server with one user per role, Redis ACL users per role) still
generates images, with no permission refused on the way. A role's credentials reach no further than
the role: the executor's cannot forge results, intake, registry writes or the executor broadcast,
cannot send another executor a dispatch (only a release, on its release subject), cannot publish
another executor's events (its own process's user), and an event the shared executor user publishes
under another executor's name is dropped by the scheduler; it cannot read the intake, cannot make
JetStream deliver stored messages to a subject of its choice;
without credentials nothing connects; the gateway's Redis user cannot write a tenant's vTime, and
executors have no Redis user at all. Stopping the stack removes its Redis users and nats-server.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid

import nats
import pytest
import redis
from nats.js.api import ConsumerConfig

from libs.launcher import brokers
from libs.launcher.creds import ADMIN, ROLES, write_compose
from libs.launcher.stack import Stack
from libs.protocol.keys import Keys
from libs.protocol.messages import Dispatch, ExecutorGoodbye, NodeFailed, OutputPlan, encode
from libs.protocol.subjects import Subjects
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.conftest import free_port
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(90)

REFUSED = ("noperm", "no permissions", "permissions violation", "authorization violation")


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory):
    _, redis_url = broker_urls
    tmp = tmp_path_factory.mktemp("secure")
    s = Stack(
        namespace="t" + uuid.uuid4().hex[:10],
        log_dir=tmp / "logs",
        model_root=tmp,
        gateway_port=free_port(),
        executors=0,
        sim_executors=2,
        sim_time_scale=0.01,
        redis_url=redis_url,
        secure=True,
    )
    s.start(timeout=60)
    try:
        yield s
    finally:
        nats_proc = s._nats
        s.stop()
        r = redis.Redis.from_url(redis_url)
        try:
            keys = list(r.scan_iter(match=Keys(s.namespace).pattern(), count=1000))
            if keys:
                r.delete(*keys)
            assert s.credentials is not None
            left = [u.name for u in s.credentials.redis.values() if r.acl_getuser(u.name)]
        finally:
            r.close()
        assert not left, f"Redis users left behind: {left}"
        assert nats_proc is not None and nats_proc.poll() is not None
        assert not (s.log_dir / "nats" / "nats.conf").exists()


class Client:
    """A NATS connection as one user, recording the errors the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None
        self.inbox = ""  # the inbox prefix: subjects under it are this user's to receive on

    async def connect(self, stack: Stack, key: str) -> Client:
        assert stack.credentials is not None
        u = stack.credentials.nats_user(key)

        async def error_cb(e: Exception) -> None:
            self.errors.append(str(e))

        self.inbox = f"_INBOX.{u.name}"
        self.nc = await nats.connect(
            stack.bus_url,
            user=u.name,
            password=u.password,
            inbox_prefix=self.inbox,
            error_cb=error_cb,
            allow_reconnect=False,
        )
        return self

    async def refused(self, what: str, subject: str, wait_s: float = 10.0) -> bool:
        """Whether the server refused ``what`` (Publish, Subscription) to ``subject`` (its error
        may come a little after the flush that followed the attempt)."""
        expected = f'permissions violation for {what} to "{subject}"'.lower()
        return await until(lambda: any(expected in e.lower() for e in self.errors), wait_s)


FORGED = b'{"type":"forged"}'


async def listen(nc: nats.NATS, subjects: list[str], only: bytes | None = None) -> list[str]:
    """The subjects on which messages arrive; with ``only``, messages with that payload alone
    (the scheduler's own broadcasts on ``exec.all`` may come at any moment)."""
    got: list[str] = []

    async def cb(msg) -> None:
        if only is None or msg.data == only:
            got.append(msg.subject)

    for subject in subjects:
        await nc.subscribe(subject, cb=cb)
    await nc.flush()
    return got


async def watch(nc: nats.NATS, namespace: str, subjects: list[str], only: bytes | None = None) -> list[str]:
    """As :func:`listen`, through one subscription to every subject of ``namespace``: the server
    delivers what one connection published there in the order it took the messages, whatever
    their subjects, and the callback sees them in that order (one subscription, one at a time)."""
    got: list[str] = []
    wanted = set(subjects)

    async def cb(msg) -> None:
        if msg.subject in wanted and (only is None or msg.data == only):
            got.append(msg.subject)

    await nc.subscribe(f"{namespace}.>", cb=cb)
    await nc.flush()
    return got


def test_a_secured_stack_generates_an_image_without_a_refusal(stack):
    spec = json.loads(encode_spec(sim_workflow("sim-wf", "sd3-medium", steps=3)))
    status, body = stack.http("POST", "/v1/workflows", spec)
    assert status == 201, body
    status, body = stack.http(
        "POST", "/v1/images/generations", {"model": "sim-wf", "prompt": "x"}, timeout=30
    )
    assert status == 200, (body, stack.tail("scheduler"), stack.tail("sim-executors"))
    assert body["data"][0]["b64_json"]
    for name in stack.procs:
        log = stack.read_log(name).lower()
        assert not any(r in log for r in REFUSED), stack.tail(name)
    server_log = (stack.log_dir / "nats" / "nats-server.log").read_text()
    assert "Violation" not in server_log, server_log[-3000:]


async def test_the_executor_user_cannot_forge_results_intake_registry_writes_or_broadcasts(stack):
    s = Subjects(stack.namespace)
    admin = await Client().connect(stack, ADMIN)
    ex = await Client().connect(stack, "sim-executors")
    assert admin.nc and ex.nc
    try:
        forged = [s.result("forged"), s.intake, s.registry("register"), s.executors_all, s.executor("nobody")]
        allowed = s.executor_release("nobody")  # ReleaseTensors to a producer: the control
        got = await watch(admin.nc, stack.namespace, [*forged, allowed], only=FORGED)
        for subject in [*forged, allowed]:
            await ex.nc.publish(subject, FORGED)
        await ex.nc.flush()
        # Handshake: the allowed publish went last, on the same connection, and reaches the same
        # subscription; once it is in, any forged one the server let through would be before it.
        assert await until(lambda: allowed in got), f"the allowed publish never arrived: {got}"
        assert got == [allowed]
        for subject in forged:
            assert await ex.refused("Publish", subject), (subject, ex.errors)
    finally:
        await ex.nc.close()
        await admin.nc.close()


async def test_an_executor_cannot_dispatch_to_another_nor_report_as_another(stack):
    s = Subjects(stack.namespace)
    ids = stack.executor_ids()["sim-executors"]
    mine, theirs = ids[0], f"{stack.namespace}-executor-9"
    admin = await Client().connect(stack, ADMIN)
    ex = await Client().connect(stack, "sim-executors")  # the launcher's per-process user
    shared = await Client().connect(stack, "executor")  # the generic user (compose replicas share it)
    assert admin.nc and ex.nc and shared.nc
    try:
        watched = [s.executor(mine), s.executor(theirs), s.executor_events(theirs)]
        seen = await watch(admin.nc, stack.namespace, watched)
        dispatch = Dispatch("r-forged", 1, "n", "t", "toy.fn", "m", {}, [OutputPlan("out")])
        failed = NodeFailed(theirs, "r-forged", 1, "n", "forged")
        for who in (ex, shared):
            assert who.nc
            await who.nc.publish(s.executor(mine), encode(dispatch))
            await who.nc.publish(s.executor(theirs), encode(dispatch))
            await who.nc.flush()
        await ex.nc.publish(s.executor_events(theirs), encode(failed))  # not one of its ids
        await ex.nc.flush()
        for who in (ex, shared):
            for subject in (s.executor(mine), s.executor(theirs)):
                assert await who.refused("Publish", subject), (subject, who.errors)
        assert await ex.refused("Publish", s.executor_events(theirs)), ex.errors
        # The shared user may publish any executor's events subject: the scheduler holds each event
        # to the executor its subject names.
        goodbye = ExecutorGoodbye(mine)  # believed, it would take a live executor out
        await shared.nc.publish(s.executor_events(theirs), encode(goodbye))
        await shared.nc.flush()
        # Handshake: every publish above was flushed (the server had taken it) before the goodbye
        # was sent, so anything of theirs the server let through reached the admin's subscription
        # before the goodbye did.
        assert await until(lambda: s.executor_events(theirs) in seen), f"no goodbye: {seen}"
        assert seen == [s.executor_events(theirs)], seen
        claimed = f"claiming executor {mine!r}"
        assert await until(lambda: claimed in stack.read_log("scheduler")), stack.tail("scheduler")
        # The scheduler decides on an event as it handles it: dropped as a forgery (the line just
        # read) or believed (the executor removed there and then), never both, never later.
        assert f"executor {mine} removed" not in stack.read_log("scheduler")
    finally:
        for c in (ex, shared, admin):
            assert c.nc
            await c.nc.close()


async def test_the_executor_user_cannot_read_the_intake_or_redirect_stored_messages(stack):
    s = Subjects(stack.namespace)
    admin = await Client().connect(stack, ADMIN)
    ex = await Client().connect(stack, "sim-executors")
    assert admin.nc and ex.nc
    js = ex.nc.jetstream(timeout=0.5)
    try:
        # The launcher gives each executor process a user that may receive its own executors'
        # messages only: not another executor's dispatches.
        other = s.executor(f"{stack.namespace}-executor-9")
        spied: list[str] = []

        async def spy(msg) -> None:
            spied.append(msg.subject)

        spies = [await ex.nc.subscribe(x, cb=spy) for x in (s.intake, s.result("*"), s.sched_events, other)]
        heard = asyncio.Event()  # the handshake below, on a subject the executor user may receive

        async def handshake(msg) -> None:
            heard.set()

        await ex.nc.subscribe(f"{ex.inbox}.handshake", cb=handshake)
        await ex.nc.flush()
        for subject in (s.intake, s.result("*"), s.sched_events, other):
            assert await ex.refused("Subscription", subject), (subject, ex.errors)
        for read in (
            lambda: js.pull_subscribe(s.intake, durable="spy", stream=s.intake_stream),
            lambda: js.get_msg(s.intake_stream, seq=1),
            lambda: js.stream_info(s.intake_stream),
        ):
            with pytest.raises(nats.errors.TimeoutError):
                await read()
        # A consumer on the images stream (which executors write) delivering to a results subject
        # would publish whatever the executor stored there as a result, past its permissions.
        redirected = await listen(admin.nc, [s.result("*")])
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(
                f"OBJ_{s.images_bucket}", ConsumerConfig(deliver_subject=s.result("redirected"))
            )
        # What the spy would have seen (not the intake: a message there would be taken in as a
        # request), then the handshake: the server delivers one connection's messages to another
        # in order, and the executor's client queues each for its subscription as it reads it. So
        # once the handshake is heard, a probe the spy was given is in ``spied`` or still queued.
        for probe in (s.result("probe"), s.executor_events(f"{stack.namespace}-executor-9"), other):
            await admin.nc.publish(probe, b"{}")
        await admin.nc.publish(f"{ex.inbox}.handshake", b"")
        await admin.nc.flush()
        assert await until(heard.is_set), "the handshake never reached the executor user"
        assert spied == [] and all(sub.pending_msgs == 0 for sub in spies), spied
        assert await until(lambda: s.result("probe") in redirected), "the admin missed the probe"
        assert redirected == [s.result("probe")]
        assert await ex.refused("Publish", f"$JS.API.CONSUMER.CREATE.OBJ_{s.images_bucket}")
        # The server refused the create, so JetStream never saw it: no consumer of the images
        # stream delivers to a results subject, so none can redirect stored messages later.
        consumers = await admin.nc.jetstream().consumers_info(f"OBJ_{s.images_bucket}")
        targets = [c.config.deliver_subject or "" for c in consumers]
        assert not [t for t in targets if t.startswith(s.result(""))], targets
    finally:
        await ex.nc.close()
        await admin.nc.close()


async def test_no_or_wrong_credentials_do_not_connect(stack):
    assert stack.credentials is not None
    user = stack.credentials.nats_user("gateway").name
    for auth in ({}, {"user": user, "password": "wrong"}):
        with pytest.raises(Exception) as e:
            await nats.connect(stack.bus_url, allow_reconnect=False, connect_timeout=2, **auth)
        assert "uthorization" in repr(e.value) or "NoServers" in repr(e.value), e.value


def test_redis_users_are_limited_to_their_keys_and_executors_only_to_gpu_leases(stack):
    creds = stack.credentials
    assert creds is not None
    assert creds.env("sim-executors", "executor")["T2I_REDIS_USER"] == creds.redis["executor"].name
    k = Keys(stack.namespace)

    def as_role(role: str) -> redis.Redis:
        return redis.Redis.from_url(creds.redis_url(stack.redis_url, role))

    gateway, registry, scheduler = as_role("gateway"), as_role("registry"), as_role("scheduler")
    executor = as_role("executor")
    try:
        # An executor reaches its GPU lease keys (libs/common/gpu_lease.py) and nothing else.
        lease = f"{stack.namespace}:gpu:box:0"
        assert executor.set(lease, "me", nx=True, px=5000) and executor.get(lease) == b"me"
        assert executor.delete(lease) == 1
        for touch in (lambda: executor.hgetall(k.vtime), lambda: executor.set(k.request("x"), "1")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                touch()
        assert gateway.hgetall(k.vtime) is not None  # it reads the counters (the admin view) ...
        for write in (
            lambda: gateway.hset(k.vtime, "alice", "0"),  # ... but cannot reset a tenant's vTime
            lambda: registry.hset(k.vtime, "alice", "0"),
            lambda: gateway.hset(k.workflow_index, "x", "1"),  # nor register a workflow
            lambda: scheduler.set("other-ns:key", "1"),  # nor anyone leave the namespace
            lambda: scheduler.set(k.request("x"), "1"),  # SET reaches its lease keys only
            lambda: gateway.flushdb(),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        assert scheduler.hset(k.vtime, "probe", "1") == 1  # the control: the scheduler may
        # The running scheduler took its lease (a script: SET NX PX, INCR) under its ACL.
        assert scheduler.get(k.scheduler_lease) is not None and int(scheduler.get(k.scheduler_epoch)) >= 1
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(stack.redis_url, username=creds.redis["gateway"].name, password="x").ping()
    finally:
        for r in (gateway, registry, scheduler, executor):
            r.close()


def test_compose_credentials_load_in_nats_server_and_redis_server(tmp_path):
    """What ``deploy/compose.yaml``'s init container writes: valid for both servers, each role's
    password file logs it in, the default Redis user is off and the health user can only PING."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    assert write_compose(tmp_path, "tcompose") and not write_compose(tmp_path, "tcompose")  # kept
    check = subprocess.run(
        [brokers.nats_server_binary(), "-c", str(tmp_path / "nats" / "auth.conf"), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--aclfile", str(tmp_path / "redis" / "users.acl")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:

        def health_pings() -> bool:  # unauthenticated PING gets NOAUTH now: the health user's
            try:
                return redis.Redis(port=port, username="health", password="health").ping()
            except redis.exceptions.ConnectionError:
                return False

        brokers.wait_until(health_pings, 10, "redis-server", proc)
        anonymous = redis.Redis(port=port)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.get("tcompose:vtime")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, username="default", password="").ping()
        health = redis.Redis(port=port, username="health", password="health")
        assert health.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            health.get("tcompose:vtime")
        health.close()
        for role in ROLES:
            pw = tmp_path / role / "redis_password"
            assert (tmp_path / role / "nats_password").exists()
            r = redis.Redis(port=port, username=f"tcompose-{role}", password=pw.read_text())
            assert r.ping()
            r.close()
        admin = redis.Redis(
            port=port, username="tcompose-admin", password=(tmp_path / "admin" / "redis_password").read_text()
        )
        assert admin.set("tcompose:x", "1")
        admin.close()
        anonymous.close()
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_images_bucket_reads_objects_chunk_by_chunk_without_a_consumer(common):
    """``ImageBucket.get`` (no consumer, so no role needs CONSUMER.CREATE): objects of several
    chunks, an overwritten one, an empty one, and a missing one."""
    from nats.js.errors import ObjectNotFoundError

    from libs.common.jetstream import ensure_images_bucket
    from libs.common.nats_conn import connect

    nc = await connect(common.nats_url, "test-images")
    try:
        js = nc.jetstream()
        images = await ensure_images_bucket(js, Subjects(common.namespace))
        big = bytes(range(256)) * 1500  # 384000 bytes: three 128 KiB chunks
        await images.put("a/big.png", big)
        await images.put("a/small.png", b"first")
        await images.put("a/small.png", b"second")
        await images.put("a/empty.png", b"")
        assert (await images.get("a/big.png")).data == big
        assert (await images.get("a/small.png")).data == b"second"
        assert (await images.get("a/empty.png")).data == b""
        consumers = await js.consumers_info(f"OBJ_{Subjects(common.namespace).images_bucket}")
        assert consumers == []
        await images.delete("a/big.png")
        with pytest.raises(ObjectNotFoundError):
            await images.get("a/big.png")
    finally:
        await nc.close()
