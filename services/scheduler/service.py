"""The scheduler's asyncio shell: NATS, Redis and timers around :class:`SchedulerCore`.

Inputs: image requests from the JetStream intake (a work queue with a durable pull consumer, so a
request survives a scheduler crash: it is acked only when it ends and kept alive with
``in_progress`` meanwhile), and executor events (heartbeats, completions, failures). Every input
becomes one synchronous call on the core; the returned effects are carried out here: dispatches
are sent as request/reply to the executor (its ``Ack`` or silence goes back into the core), request
state is written to Redis, results are published to the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from redis.asyncio import Redis

from libs.common.jetstream import ensure_intake_stream
from libs.common.registry_client import RegistryClient, RegistryUnavailable, WorkflowNotFound
from libs.common.service import run_all
from libs.protocol.keys import Keys
from libs.protocol.messages import (
    ExecutorGoodbye,
    ExecutorHeartbeat,
    NodeComplete,
    NodeFailed,
    ReleaseRequest,
    RequestResult,
    ack_decoder,
    encode,
    intake_decoder,
    sched_decoder,
)
from libs.protocol.subjects import Subjects
from libs.workflow.dag import unroll
from libs.workflow.errors import ParamError
from libs.workflow.params import resolve_params
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.effects import (
    ChargeVTime,
    Effect,
    Finished,
    PersistRequest,
    ReleaseAttempt,
    SendCallback,
    SendDispatch,
)
from services.scheduler.vtime_store import VTimeStore

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,80}$")


class SchedulerService:
    def __init__(
        self,
        *,
        nc: Client,
        redis: Redis,
        subjects: Subjects,
        keys: Keys,
        core: SchedulerCore,
        cfg: SchedulerConfig,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.redis = redis
        self.subjects = subjects
        self.keys = keys
        self.core = core
        self.cfg = cfg
        self.registry = RegistryClient(nc, subjects)
        self.vtimes = VTimeStore(redis, keys)
        self._intake_msgs: dict[str, Msg] = {}  # request id -> its JetStream message (acked at the end)
        self._io: asyncio.Queue[Effect] = asyncio.Queue(maxsize=100_000)
        self._tasks: set[asyncio.Task] = set()
        self._subs: list = []
        self._pull: JetStreamContext.PullSubscription | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        vtime, ops, service = await self.vtimes.load()
        self.core.accounts.load(vtime, ops, service)
        if vtime:
            log.info(
                "resumed tenant vTime from Redis: %s", {t: round(v, 3) for t, v in sorted(vtime.items())}
            )
        await ensure_intake_stream(self.js, self.subjects)
        self._pull = await self.js.pull_subscribe(
            self.subjects.intake,
            durable=self.subjects.intake_durable,
            stream=self.subjects.intake_stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.cfg.ack_wait_s,
                max_deliver=5,
                max_ack_pending=max(self.cfg.max_active * 2, 100),
            ),
        )
        self._subs.append(await self.nc.subscribe(self.subjects.sched_events, cb=self._on_event))
        log.info("scheduler ready (namespace %s)", self.subjects.ns)

    async def run(self) -> None:
        """The long-lived loops; the service stops if any of them ends."""
        await run_all(self.intake_loop(), self.io_loop(), self.tick_loop(), self.progress_loop())

    async def stop(self) -> None:
        if self._pull is not None:
            # nats-py's drain waits for a pull subscription's queue to empty, which status messages
            # arriving after the last fetch never do: unsubscribe it first.
            try:
                await self._pull.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass
            self._pull = None
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass
        self._subs.clear()
        for t in list(self._tasks):
            t.cancel()

    # -- intake ---------------------------------------------------------------------------------------
    async def intake_loop(self) -> None:
        while self._pull is not None:
            room = self.cfg.max_active - self.core.active
            if room <= 0:
                await asyncio.sleep(self.cfg.tick_s)  # backpressure: requests wait in JetStream
                continue
            try:
                msgs = await self._pull.fetch(batch=min(room, 32), timeout=1.0)  # type: ignore[union-attr]
            except (NatsTimeoutError, TimeoutError):
                continue
            for m in msgs:
                try:
                    await self.on_intake(m)
                except Exception:  # noqa: BLE001 - one bad request must not stop intake
                    log.exception("intake of a request failed; it will be redelivered")

    async def on_intake(self, m: Msg) -> None:
        try:
            req = intake_decoder.decode(m.data)
        except msgspec.DecodeError as e:
            log.error("dropped a malformed image request: %s", e)
            await m.term()
            return
        if not REQUEST_ID.match(req.request_id) or not req.tenant:
            log.error("dropped an image request with a bad id %r or no tenant", req.request_id)
            await m.term()
            return
        rid = req.request_id
        if rid in self.core.runs:  # redelivered while in progress: keep the newest handle
            self._intake_msgs[rid] = m
            return
        state = await self.redis.hgetall(self.keys.request(rid))
        if state.get(b"status") in (b"succeeded", b"failed") and b"result" in state:
            # Finished before a crash lost the ack: answer again instead of recomputing.
            await self.nc.publish(self.subjects.result(rid), state[b"result"])
            await m.ack()
            return
        try:
            spec = await self.registry.get(req.workflow, req.version)
            params = resolve_params(spec, req.params)
            dag = unroll(spec, params)
        except RegistryUnavailable as e:
            log.warning("registry unavailable for %s: %s; retrying later", rid, e)
            await m.nak(delay=1.0)
            return
        except (WorkflowNotFound, ParamError) as e:
            code = "bad_params" if isinstance(e, ParamError) else "workflow"
            await self._finish(RequestResult(rid, "failed", error=str(e), error_code=code), req.tenant, m)
            return
        attempt = int(await self.redis.hincrby(self.keys.request(rid), "attempt", 1))
        if attempt > 1:
            # A previous scheduler worked on this request: free whatever it left on executors.
            await self.nc.publish(self.subjects.executors_all, encode(ReleaseRequest(rid, -1)))
        self._intake_msgs[rid] = m
        now = time.monotonic()
        self._apply(self.core.add_request(req, dag, attempt=attempt, now=now) + self.core.schedule(now))

    # -- events ---------------------------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = sched_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed event: %s", e)
            return
        now = time.monotonic()
        try:
            match ev:
                case ExecutorHeartbeat():
                    effects = self.core.on_heartbeat(ev, now)
                case NodeComplete():
                    effects = self.core.on_complete(ev, now)
                case NodeFailed():
                    effects = self.core.on_failed(ev, now)
                case ExecutorGoodbye(executor=ex):
                    effects = self.core.remove_executor(ex, now, "said goodbye")
            self._apply(effects + self.core.schedule(now))
        except Exception:  # noqa: BLE001 - one bad event (or a core bug) is logged; the loop lives on
            log.exception("handling %s failed", type(ev).__name__)

    # -- effects ----------------------------------------------------------------------------------------
    def _apply(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, SendDispatch):
                t = asyncio.create_task(self._send_dispatch(e))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            else:
                self._io.put_nowait(e)  # in order: a callback's metadata follows its dispatch

    async def _send_dispatch(self, e: SendDispatch) -> None:
        node = e.msg.ref
        try:
            reply = await self.nc.request(
                self.subjects.executor(e.executor), encode(e.msg), timeout=self.cfg.dispatch_timeout_s
            )
            ack = ack_decoder.decode(reply.data)
            ok, seq, error = ack.ok, ack.seq, ack.error
        except (NoRespondersError, NatsTimeoutError, TimeoutError) as ex:
            ok, seq, error = False, 0, f"no answer ({type(ex).__name__})"
        except msgspec.DecodeError as ex:
            ok, seq, error = False, 0, f"malformed ack: {ex}"
        now = time.monotonic()
        try:
            effects = self.core.dispatch_result(node, e.executor, ok=ok, seq=seq, error=error, now=now)
            effects += self.core.schedule(now)
        except Exception:  # noqa: BLE001 - e.g. an IllegalTransition (a core bug): log, keep serving
            log.exception("handling the answer to dispatch %s failed", node)
            return
        self._apply(effects)

    async def io_loop(self) -> None:
        while True:
            e = await self._io.get()
            try:
                match e:
                    case ChargeVTime():
                        await self.vtimes.apply(e)
                    case PersistRequest():
                        await self._persist(e)
                    case SendCallback(executor=ex, msg=ready):
                        await self.nc.publish(self.subjects.executor(ex), encode(ready))
                    case ReleaseAttempt(attempt=ref):
                        await self.nc.publish(
                            self.subjects.executors_all, encode(ReleaseRequest(ref.request_id, ref.attempt))
                        )
                    case Finished(result=result, tenant=tenant):
                        await self._finish(result, tenant, self._intake_msgs.pop(result.request_id, None))
                    case _:
                        log.error("no handler for effect %r", e)  # a bug: every effect must be handled
            except Exception:  # noqa: BLE001
                log.exception("carrying out %s failed", type(e).__name__)

    async def _persist(self, e: PersistRequest) -> None:
        key = self.keys.request(e.request_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={**e.fields, "updated_at": time.time()})
        pipe.expire(key, self.cfg.request_ttl_s)
        tkey = self.keys.tensors(e.request_id)
        if e.tensors:
            pipe.hset(tkey, mapping={tid: msgspec.json.encode(m) for tid, m in e.tensors.items()})
            pipe.expire(tkey, self.cfg.request_ttl_s)
        if e.drop_tensors:
            pipe.delete(tkey)
        await pipe.execute()

    async def _finish(self, result: RequestResult, tenant: str, m: Msg | None) -> None:
        data = encode(result)
        key = self.keys.request(result.request_id)
        await self.redis.hset(key, mapping={"status": result.status, "result": data, "tenant": tenant})
        await self.redis.expire(key, self.cfg.request_ttl_s)
        await self.nc.publish(self.subjects.result(result.request_id), data)
        if m is not None:
            try:
                await m.ack()
            except Exception as ex:  # noqa: BLE001 - the result is out; a lost ack only means a redelivery
                log.warning("ack of %s failed: %s", result.request_id, ex)
        log.info(
            "request %s %s: %d nodes on %s, %d bytes moved, %.3fs executor time%s",
            result.request_id,
            result.status,
            result.nodes,
            ",".join(result.executors) or "-",
            result.bytes_moved,
            result.gpu_s,
            f" ({result.error})" if result.error else "",
        )

    # -- timers ---------------------------------------------------------------------------------------------
    async def tick_loop(self) -> None:
        last_stats = last_view = 0.0
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            now = time.monotonic()
            try:
                self._apply(self.core.expire(now) + self.core.schedule(now))
            except Exception:  # noqa: BLE001
                log.exception("scheduler tick failed")
            if now - last_view >= self.cfg.view_s:
                last_view = now
                await self._publish_tenants(log_it=now - last_stats > 10.0)
                if now - last_stats > 10.0:
                    last_stats = now
                    log.info("state: %s", self.core.stats())

    async def _publish_tenants(self, log_it: bool) -> None:
        """The operator view: per-tenant vTime, service and queued/running work, in Redis."""
        view = self.core.tenant_stats()
        if not view:
            return
        try:
            await self.redis.hset(
                self.keys.tenants, mapping={t: msgspec.json.encode(v) for t, v in view.items()}
            )
        except Exception as e:  # noqa: BLE001 - the view is refreshed next second
            log.warning("writing the tenant view failed: %s", e)
        if log_it:
            for tenant, v in sorted(view.items()):
                log.info("tenant %s: %s", tenant, " ".join(f"{k}={v[k]}" for k in sorted(v)))

    async def progress_loop(self) -> None:
        """Keep in-progress intake messages from being redelivered while their request runs."""
        while True:
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            for rid, m in list(self._intake_msgs.items()):
                if rid in self.core.runs:
                    try:
                        await m.in_progress()
                    except Exception as e:  # noqa: BLE001
                        log.warning("in_progress for %s failed: %s", rid, e)
