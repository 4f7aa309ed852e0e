"""No request lost at the scheduler: the real scheduler, registry and simulated executors, in this
process, over real NATS and Redis, with faults injected where they happen in production.

* the registry does not answer for ~10 s (nobody subscribed, then a subscriber that never replies)
  while requests arrive: they are kept, not nak-ed away, and all complete once it is back;
* Redis drops out (a TCP proxy in front of the real server, cut and restored) while requests are
  taken in, and while one finishes: the result is still published at once, stored once Redis is
  back, and nothing is recomputed;
* deadlines count from ``submitted_at``: an expired request is answered ``timeout`` at once;
* a node that never finishes (a simulated executor whose first node never ends) is cancelled on
  its executor after its time limit (``CancelNode``) and rerun on another; the request completes,
  and the executor's answer puts it back into service at once;
* a forged completion with a negative or non-finite time is dropped and the node reruns;
* an event on another executor's events subject than the one it names is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import msgspec
import pytest
from nats.js.api import ConsumerConfig
from redis.asyncio import Redis

from libs.common.jetstream import ensure_images_bucket, ensure_intake_stream
from libs.common.nats_conn import connect
from libs.common.redis_conn import connect_redis, connect_redis_sync
from libs.common.service import own
from libs.protocol.keys import Keys
from libs.protocol.messages import (
    ExecutorGoodbye,
    ImageRequest,
    NodeComplete,
    NodeTiming,
    RequestResult,
    encode,
    result_decoder,
    sched_decoder,
)
from libs.protocol.subjects import REGISTRY_OPS, Subjects
from libs.sim.profile import Figure, ModelProfile, Profile
from libs.sim.workflows import sim_workflow
from libs.workflow import catalog
from services.executor.service import ExecutorService
from services.executor.sim import SimRunner, SimStore
from services.registry.service import RegistryService
from services.registry.store import WorkflowStore
from services.scheduler.__main__ import build_machine
from services.scheduler.config import SchedulerConfig
from services.scheduler.shell.lease import Lease
from services.scheduler.shell.service import SchedulerService
from services.scheduler.shell.succession import Succession
from tests.support.waiting import elapse, until

pytestmark = pytest.mark.timeout(120)

STEPS = 2
WORKFLOW = "wf"
PARTS = ("text", "prepare", "dit", "vae")
NODES = 2 + STEPS + 1  # text, prepare, one dit per step, vae


def fig(v: float) -> Figure:
    return Figure(v, "P", "test")


def profile(exec_s: dict[str, float] | None = None, default_s: float = 0.02) -> Profile:
    """The ``fam/*`` models of :func:`sim_workflow`, each running ``default_s`` unless given."""
    times = exec_s or {}
    return Profile(
        name="faults",
        description="scheduler fault tests",
        device="sim",
        gpu_memory_gb=fig(80),
        models={
            f"fam/{p}": ModelProfile(
                size_gb=fig(0.1), load_s=fig(0.0), exec_s=fig(times.get(p, default_s)), output_bytes=4096
            )
            for p in PARTS
        },
    )


class HangsOnce(SimRunner):
    """Its first node never ends (until cancelled); the rest run as the profile says."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hung = False

    async def run(self, d, blobs=None):
        if not self.hung:
            self.hung = True
            await asyncio.Event().wait()
        return await super().run(d, blobs)


class Proxy:
    """A TCP proxy in front of the real Redis that can be cut (connections reset, new ones refused)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.down = False
        self.conns: set[asyncio.StreamWriter] = set()
        self.server: asyncio.AbstractServer | None = None
        self.listen = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.listen = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.transport.abort()
            return
        if self.down:  # cut while this connection was being made: it must not carry traffic
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self.conns |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.conns -= {writer, up_writer}

    def cut(self) -> None:
        self.down = True
        for w in list(self.conns):
            w.transport.abort()

    def restore(self) -> None:
        self.down = False

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class World:
    """A scheduler, optionally a registry, and simulated executors in this event loop."""

    def __init__(self, common) -> None:
        self.common = common
        self.ns = common.namespace
        self.subjects = Subjects(self.ns)
        self.keys = Keys(self.ns)
        self.results: dict[str, RequestResult] = {}
        self.tasks: list[asyncio.Task] = []
        self.closers: list = []
        self.executors: dict[str, ExecutorService] = {}
        self.registry: RegistryService | None = None
        self.successions: list[Succession] = []  # scheduler processes, each in a task
        self.succession_tasks: list[asyncio.Task] = []
        self.proxy: Proxy | None = None

    async def __aenter__(self) -> World:
        self.nc = await connect(self.common.nats_url, "test")
        self.js = self.nc.jetstream()
        self.redis = Redis.from_url(self.common.redis_url)
        await self.nc.subscribe(f"{self.ns}.results.>", cb=self._on_result)
        spec = sim_workflow(WORKFLOW, "fam", steps=STEPS)
        stored, _ = await WorkflowStore(self.redis, self.keys).put(spec)  # as if registered earlier
        self.version = stored.version
        return self

    async def _on_result(self, msg) -> None:
        r = result_decoder.decode(msg.data)
        self.results.setdefault(r.request_id, r)

    async def __aexit__(self, *exc) -> None:
        for ex in self.executors.values():
            await ex.stop()
        for t in self.succession_tasks:  # a clean stop of each scheduler process
            t.cancel()
        await asyncio.gather(*self.succession_tasks, return_exceptions=True)
        await self.stop_registry()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                await close()
        if self.proxy is not None:
            await self.proxy.close()
        await self.redis.aclose()
        await self.nc.close()

    def _run(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.append(t)
        return t

    @property
    def scheduler(self) -> SchedulerService | None:
        """The first scheduler process's current service (the leader, in most tests)."""
        return self.successions[0].current if self.successions else None

    async def start_scheduler(self, via_proxy: bool = False, **settings) -> SchedulerService:
        """A scheduler process (a :class:`Succession`, as ``python -m services.scheduler`` runs),
        once it leads."""
        succession = self.add_scheduler(via_proxy, **settings)
        assert await until(lambda: succession.leading, 30.0), "the scheduler did not take the lease"
        assert succession.current is not None
        return succession.current

    def add_scheduler(self, via_proxy: bool = False, **settings) -> Succession:
        """A scheduler process running in this event loop: it leads once it takes the lease, and
        after stepping down starts again as a standby (its own connections each time)."""
        # Through the proxy, Redis outages outlast the default lease TTL (a leader that cannot renew
        # its lease steps down): these tests are about the scheduler riding them out.
        lease_ttl = {"lease_ttl_s": 60.0} if via_proxy else {}
        cfg = SchedulerConfig(**{"heartbeat_timeout_s": 5.0, "tick_s": 0.1, **lease_ttl, **settings})
        succession = Succession(lambda stack: self._build_scheduler(stack, cfg, via_proxy))
        task = self._run(succession.run())
        self.successions.append(succession)
        self.succession_tasks.append(task)
        return succession

    async def _build_scheduler(
        self, stack: contextlib.AsyncExitStack, cfg: SchedulerConfig, via_proxy: bool
    ) -> SchedulerService:
        redis_url = self.common.redis_url
        if via_proxy:
            if self.proxy is None:
                host_port = redis_url.split("//", 1)[1].split("/", 1)[0]
                host, port = host_port.rsplit(":", 1)
                self.proxy = Proxy(host, int(port))
                await self.proxy.start()
            redis_url = f"redis://127.0.0.1:{self.proxy.listen}/0"
        nc = await connect(self.common.nats_url, "scheduler")
        own(stack, nc.close, "nats")
        redis = connect_redis(redis_url)
        own(stack, redis.aclose, "redis")
        machine = build_machine(
            stack, cfg
        )  # as python -m services.scheduler builds it (recorded with ``record``)
        timeout_s = min(1.0, cfg.lease_ttl_s / 3)
        lease = Lease(
            lambda: connect_redis_sync(redis_url, timeout_s), self.keys, cfg.lease_ttl_s, cfg.lease_poll_s
        )
        return SchedulerService(
            nc=nc, redis=redis, subjects=self.subjects, keys=self.keys, machine=machine, cfg=cfg, lease=lease
        )

    async def start_registry(self) -> None:
        nc = await connect(self.common.nats_url, "registry")
        redis = Redis.from_url(self.common.redis_url)
        self._registry_conns = (nc, redis)
        self.registry = RegistryService(
            nc, WorkflowStore(redis, self.keys), catalog.signatures(), self.subjects
        )
        await self.registry.start()

    async def stop_registry(self) -> None:
        if self.registry is not None:
            await self.registry.stop()
            nc, redis = self._registry_conns
            await nc.close()
            await redis.aclose()
            self.registry = None

    async def add_executor(self, name: str, prof: Profile, runner_cls=SimRunner) -> ExecutorService:
        nc = await connect(self.common.nats_url, name)
        self.closers.append(nc.close)
        eid = f"{self.ns}-{name}"
        store = SimStore(eid, 1 << 24)
        ex = ExecutorService(
            executor_id=eid,
            kind="sim",
            nc=nc,
            subjects=self.subjects,
            store=store,
            runner=runner_cls(prof, store),
            images=await ensure_images_bucket(nc.jetstream(), self.subjects),
            fns=catalog.names(),
            heartbeat_s=0.2,
        )
        await ex.start()
        self._run(ex.run())
        self.executors[name] = ex
        return ex

    async def submit(
        self,
        n: int = 1,
        *,
        submitted_at: float | None = None,
        timeout_s: float = 300.0,
        tenant: str = "tenant-a",
    ) -> list[str]:
        ids = []
        for _ in range(n):
            rid = "r" + uuid.uuid4().hex[:12]
            req = ImageRequest(
                rid,
                tenant,
                WORKFLOW,
                self.version,
                {"prompt": "x", "seed": 0, "num_inference_steps": STEPS},
                submitted_at=time.time() if submitted_at is None else submitted_at,
                timeout_s=timeout_s,
            )
            await self.js.publish(self.subjects.intake, encode(req), headers={"Nats-Msg-Id": rid})
            ids.append(rid)
        return ids

    async def wait_results(self, ids: list[str], within_s: float) -> dict[str, RequestResult]:
        await until(lambda: all(r in self.results for r in ids), within_s)
        return {r: self.results[r] for r in ids if r in self.results}

    async def consumer(self):
        return await self.js.consumer_info(self.subjects.intake_stream, self.subjects.intake_durable)

    async def drained(self) -> bool:
        """Whether every request submitted has been acked: no scheduler holds one any more, so
        every result there will be was published (a result goes out before its ack, on the same
        connection, so it reached our subscription before this answer did)."""
        info = await self.consumer()
        return info.num_ack_pending == 0 and info.num_pending == 0


@pytest.fixture
async def world(common):
    async with World(common) as w:
        yield w


# -- 1. transient failures at intake keep the message -----------------------------------------------------
async def test_requests_submitted_while_the_registry_is_unreachable_all_complete_when_it_returns(world):
    # ack_wait shorter than the outage: only the keep-alives stop JetStream redelivering meanwhile.
    sched = await world.start_scheduler(ack_wait_s=2.0, registry_timeout_s=1.0, retry_max_s=1.0)
    await world.add_executor("sim-0", profile())
    await world.add_executor("sim-1", profile())
    ids = await world.submit(4)

    def retrying() -> bool:  # every request submitted is held, its take-in retrying
        return set(ids) <= set(sched.intake.taking)

    assert await until(retrying, 10.0), "the requests were not taken in"
    await elapse(4.0, because="nobody answers registry lookups (no responders) for twice the ack wait")
    ids += await world.submit(2)
    silent = [await world.nc.subscribe(world.subjects.registry(op)) for op in REGISTRY_OPS]
    await world.nc.flush()  # the server has the subscriptions: from here lookups time out
    assert await until(retrying, 10.0), "the requests submitted later were not taken in"
    await elapse(6.0, because="a registry that takes lookups and never replies: several timeouts")
    # None was answered: an answer takes the request out of the intake's hands (synchronously,
    # before its result is published), and every one is still there, its take-in retrying.
    assert retrying(), f"answered while the registry was away: {set(ids) - set(sched.intake.taking)}"
    assert world.results == {}, "answered while the registry was away"
    for sub in silent:
        await sub.unsubscribe()
    await world.start_registry()
    results = await world.wait_results(ids, within_s=30.0)
    assert sorted(results) == sorted(ids), f"lost {set(ids) - set(results)}"
    assert {r.status for r in results.values()} == {"succeeded"}, results
    assert await until(world.drained, 5.0)  # acked once each result is stored (just after it is published)
    info = await world.consumer()
    assert info.num_ack_pending == 0 and info.num_pending == 0
    # Each message was delivered once: a redelivery takes a consumer sequence number of its own
    # (num_redelivered forgets a redelivered message once it is acked, so it reads 0 here anyway).
    assert info.delivered.consumer_seq == len(ids), f"redelivered: {info.delivered}"
    assert info.config.max_deliver == -1


async def test_requests_taken_in_while_redis_is_unreachable_complete_when_it_returns(world):
    await world.start_registry()
    # ack_wait far shorter than the outage, and one fetched batch: every message of it must be kept
    # alive while the first one's Redis calls fail.
    sched = await world.start_scheduler(via_proxy=True, ack_wait_s=1.0, retry_max_s=1.0)
    await world.add_executor("sim-0", profile())
    world.proxy.cut()
    ids = await world.submit(6)

    def retrying() -> bool:  # every request submitted is held, its take-in retrying
        return set(ids) <= set(sched.intake.taking)

    assert await until(retrying, 10.0), "the requests were not taken in"
    await elapse(6.0, because="Redis stays unreachable for six times the ack wait")
    # None was answered: an answer takes the request out of the intake's hands (synchronously,
    # before its result is published), and every one is still there, its take-in retrying.
    assert retrying(), f"answered while Redis was away: {set(ids) - set(sched.intake.taking)}"
    assert world.results == {}
    world.proxy.restore()
    results = await world.wait_results(ids, within_s=30.0)
    assert sorted(results) == sorted(ids) and {r.status for r in results.values()} == {"succeeded"}
    assert await until(world.drained, 5.0)  # acked once each result is stored (just after it is published)
    info = await world.consumer()
    assert info.num_ack_pending == 0
    # Each message was delivered once (a redelivery takes a consumer sequence number of its own).
    assert info.delivered.consumer_seq == len(ids), f"redelivered: {info.delivered}"


async def test_an_old_durable_with_a_delivery_limit_is_updated_to_none(world):
    await ensure_intake_stream(world.js, world.subjects)
    old = ConsumerConfig(durable_name="scheduler", filter_subject=world.subjects.intake, max_deliver=5)
    await world.js.add_consumer(world.subjects.intake_stream, config=old)
    await world.start_scheduler()
    assert (await world.consumer()).config.max_deliver == -1


async def test_a_malformed_request_with_an_id_is_answered_and_one_without_is_dropped(world):
    await world.start_scheduler()
    await world.js.publish(
        world.subjects.intake, b'{"type":"image_request","request_id":"bad-1","tenant":"t"}'
    )
    await world.js.publish(world.subjects.intake, b"not json")
    results = await world.wait_results(["bad-1"], within_s=5.0)
    assert results["bad-1"].status == "failed" and results["bad-1"].error_code == "internal"
    assert await until(world.drained, 5.0)


async def test_an_unknown_workflow_and_bad_params_are_answered_not_dropped(world):
    await world.start_registry()
    await world.start_scheduler()
    unknown = ImageRequest("unknown-1", "t", "nope", 0, {"prompt": "x"}, submitted_at=time.time())
    bad = ImageRequest("badp-1", "t", WORKFLOW, world.version, {"seed": 1}, submitted_at=time.time())
    for req in (unknown, bad):
        await world.js.publish(world.subjects.intake, encode(req))
    results = await world.wait_results(["unknown-1", "badp-1"], within_s=10.0)
    assert results["unknown-1"].error_code == "workflow" and results["badp-1"].error_code == "bad_params"
    assert await until(world.drained, 5.0)


# -- 3. deadlines from submission ----------------------------------------------------------------------------
async def test_a_request_already_past_its_deadline_is_answered_timeout_at_once_and_runs_nothing(world):
    await world.start_scheduler()  # no registry: the answer needs none
    ex = await world.add_executor("sim-0", profile())
    (rid,) = await world.submit(submitted_at=time.time() - 100.0, timeout_s=30.0)
    results = await world.wait_results([rid], within_s=5.0)
    assert results[rid].status == "failed" and results[rid].error_code == "timeout", results
    assert await until(world.drained, 5.0)
    state = await world.redis.hgetall(world.keys.request(rid))
    assert b"result" in state and result_decoder.decode(state[b"result"]).error_code == "timeout"
    # Answered at its take-in, at once: it was never queued (queuing counts its attempt up in
    # Redis first), so nothing of it was dispatched, nor can be.
    assert b"attempt" not in state, state
    assert ex.nodes_run == 0


async def test_a_submission_time_far_in_the_future_does_not_extend_the_deadline(world):
    await world.start_registry()
    await world.start_scheduler()
    ex = await world.add_executor("sim-0", profile({"dit": 1.0}))
    (rid,) = await world.submit(submitted_at=time.time() + 7200.0, timeout_s=1.0)
    results = await world.wait_results([rid], within_s=10.0)
    assert results[rid].error_code == "timeout", results  # counted from intake: 1 s, not 2 h
    # Handshake: another request, through the same scheduler to the same (only) executor. The core
    # dropped the first one before publishing its timeout, so no node of it is dispatched after
    # that; one dispatched before went out first on the same connection, and the executor runs one
    # node at a time: once the second request is done, every node of the first that ran has run.
    (marker,) = await world.submit()
    done = await world.wait_results([marker], within_s=20.0)
    assert done.get(marker) is not None and done[marker].status == "succeeded", done
    ran = ex.nodes_run - NODES  # the first request's nodes
    assert ran < NODES, f"{ran} nodes: the rest of the request was started after the deadline"


# -- 4. a node time limit ------------------------------------------------------------------------------------
async def test_a_node_that_never_finishes_is_cancelled_rerun_elsewhere_and_the_request_completes(world):
    await world.start_registry()
    sched = await world.start_scheduler(node_time_limit_s=1.0, node_time_factor=1.0)
    completions: list[NodeComplete] = []

    async def collect(msg) -> None:
        ev = sched_decoder.decode(msg.data)
        if isinstance(ev, NodeComplete):
            completions.append(ev)

    await world.nc.subscribe(world.subjects.sched_events, cb=collect)
    slow = await world.add_executor("slow", profile(), runner_cls=HangsOnce)
    (rid,) = await world.submit()
    assert await until(lambda: slow.current is not None, 5.0)
    stuck = slow.current
    fast = await world.add_executor("fast", profile())
    # Past its 1 s limit the scheduler cancels it there (the executor has no limit of its own).
    assert await until(lambda: slow.cancelled == 1, 5.0), "the hung node was never cancelled"
    results = await world.wait_results([rid], within_s=20.0)
    assert results[rid].status == "succeeded", results
    assert [c.executor for c in completions if c.ref == stuck] == [fast.id]  # rerun elsewhere, once
    # The cancelled node's NodeFailed freed the executor at once: it takes work again.
    state = sched.core.executors[slow.id]
    assert slow.current != stuck and state.hung is None
    (rid2,) = await world.submit()
    results = await world.wait_results([rid2], within_s=10.0)
    assert results[rid2].status == "succeeded"


# -- 5. Redis errors in the final bookkeeping ----------------------------------------------------------------
async def test_a_redis_outage_as_a_request_finishes_still_answers_it_and_nothing_is_recomputed(world):
    await world.start_registry()
    await world.start_scheduler(via_proxy=True, ack_wait_s=2.0, retry_max_s=0.5)
    ex = await world.add_executor("sim-0", profile({"vae": 2.0}))
    (rid,) = await world.submit()
    key = world.keys.request(rid)

    async def decoding() -> bool:  # the last node (the VAE, 2 s) is running
        state = await world.redis.hgetall(key)
        return state.get(b"nodes_done") == str(NODES - 1).encode()

    assert await until(decoding, 10.0)
    world.proxy.cut()
    results = await world.wait_results([rid], within_s=10.0)
    assert results.get(rid) is not None and results[rid].status == "succeeded", "no answer without Redis"
    assert await world.redis.hget(key, "result") is None  # Redis was not reachable to write it
    await elapse(1.0, because="Redis stays away a while after the answer: its write waits, retried")
    world.proxy.restore()

    async def stored() -> bool:
        return await world.redis.hget(key, "result") is not None

    assert await until(stored, 15.0), "the result never reached Redis"
    state = await world.redis.hgetall(key)
    assert state[b"status"] == b"succeeded" and state[b"attempt"] == b"1"
    assert result_decoder.decode(state[b"result"]).status == "succeeded"
    # Acked: once nothing is pending or unacked, no redelivery can come (a message left unacked
    # stays ack-pending, and its redelivery would be taken in again and acked only then).
    assert await until(world.drained, 15.0), "the intake message was never acked"
    info = await world.consumer()
    # Delivered once: a redelivery takes a consumer sequence number of its own (num_redelivered
    # forgets a redelivered message once it is acked).
    assert info.delivered.consumer_seq == 1, f"redelivered: {info.delivered}"
    assert ex.nodes_run == NODES  # nothing recomputed
    assert world.results[rid].status == "succeeded"


# -- 6. executors' timings are validated ---------------------------------------------------------------------
async def test_a_forged_completion_with_a_negative_or_null_time_is_dropped_and_the_node_reruns(world):
    await world.start_registry()
    sched = await world.start_scheduler()
    ex = await world.add_executor("sim-0", profile(default_s=0.5))
    (rid,) = await world.submit()
    forged = 0
    for exec_s in (-1000.0, float("nan")):  # NaN goes out as JSON null
        assert await until(lambda: ex.current is not None and ex.current.request_id == rid, 5.0)
        node = ex.current
        bad = NodeComplete(ex.id, rid, node.attempt, node.node_id, timing=NodeTiming(exec_s=exec_s))
        await world.nc.publish(world.subjects.executor_events(ex.id), encode(bad))
        forged += 1
        assert await until(lambda n=node: ex.current != n, 5.0)
    results = await world.wait_results([rid], within_s=20.0)
    assert results[rid].status == "succeeded", results
    acct = sched.core.accounts["tenant-a"]
    assert acct.vtime >= 0.0 and 0.0 < acct.service_s < 10.0
    assert results[rid].gpu_s > 0
    raw = await world.redis.hget(world.keys.vtime, "tenant-a")
    assert raw is not None and float(raw) >= 0.0
    assert forged == 2


def test_the_events_decoder_is_what_refuses_them():
    bad = encode(NodeComplete("e", "r", 1, "n", timing=NodeTiming(exec_s=-1.0)))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(bad, type=NodeComplete)


# -- 7. an executor reports for itself only --------------------------------------------------------------------
async def test_an_event_naming_another_executor_than_its_subject_is_dropped(world):
    await world.start_registry()
    sched = await world.start_scheduler()
    ex = await world.add_executor("sim-0", profile(default_s=0.3))
    (rid,) = await world.submit()
    assert await until(lambda: ex.current is not None and ex.current.request_id == rid, 5.0)
    node = ex.current
    intruder = world.subjects.executor_events(f"{world.ns}-intruder")
    for forged in (
        NodeComplete(ex.id, rid, node.attempt, node.node_id),  # no outputs: would fail the request
        NodeComplete(ex.id, rid, node.attempt, node.node_id, timing=NodeTiming(exec_s=-1.0)),  # a rerun
        ExecutorGoodbye(ex.id),  # would restart the request
    ):
        await world.nc.publish(intruder, encode(forged))
    assert await until(lambda: sched.forged_events == 3, 5.0)
    results = await world.wait_results([rid], within_s=20.0)
    assert results[rid].status == "succeeded", results
    assert ex.nodes_run == NODES and ex.id in sched.core.executors  # nothing rerun, nobody removed
    assert sched.core.runs.get(rid) is None and f"{world.ns}-intruder" not in sched.core.executors
