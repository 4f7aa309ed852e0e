"""Taking image requests in from the JetStream intake, so that none is lost (``docs/scheduling.md``).

Every intake message ends in exactly one of two ways: the request is handed to the state machine
(which always ends it with a ``Finished`` effect, hence a result), or it is answered here with a
failed :class:`RequestResult` naming why (``bad_params``, ``workflow``, ``timeout``, ``internal``),
or ``cancelled`` when its client cancelled it before it reached the core (the
``cancel`` flag of its state, read at take-in; ``control.py``). The one
exception is a message without a usable request id: there is no subject to answer on, so it is
logged and terminated.

Transient failures (the registry or Redis unreachable) never decide a request's fate and never
consume a delivery: the message is kept (``in_progress`` keep-alives, sent by the service's progress
loop for every handle in :attr:`Intake.handles`) while the take-in is retried here with back-off,
until it succeeds, fails permanently, or the request's deadline passes (a ``timeout`` result). The
consumer has no delivery limit (``max_deliver=-1``); a message delivered more than
``max_deliveries`` times — each redelivery is a scheduler that crashed or lost it — is answered
with ``internal`` instead, so a request that crashes schedulers cannot loop for ever, nor vanish.

While any take-in is retrying, new messages are taken in concurrently (each in its own task) so one
slow registry lookup does not hold up the others; otherwise they are taken in one at a time, in
the order they arrive. Every message of a fetched batch is registered (and so kept alive) before
the first is taken in.

A request taken in is posted to the scheduler's inbox (a :class:`~services.scheduler.core.events.TakenIn`,
still kept alive here); from then on its life is the state machine's (``machine.py``: the backlog,
admission in the policy's order, the per-tenant backlog limit — ``rate_limited``, docs/scheduling.md
"Per-tenant limits" — and its deadline).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.asyncio import Redis

from libs.common.logs import bind_request
from libs.common.registry_client import RegistryClient, WorkflowNotFound
from libs.common.watchdog import TimeSlice
from libs.errors import T2IError
from libs.protocol.keys import Keys
from libs.protocol.messages import ImageRequest, ReleaseRequest, RequestResult, encode, intake_decoder
from libs.protocol.subjects import Subjects
from libs.workflow.dag import Dag, unroll
from libs.workflow.errors import ParamError
from libs.workflow.params import resolve_params
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.admission import Queued
from services.scheduler.core.deadlines import Deadline, deadline_of
from services.scheduler.core.events import TakenIn
from services.scheduler.core.machine import cancelled, failed
from services.scheduler.shell.retrying import Backoff, is_transient

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,80}$")

# finish(result, tenant, message): publish a result, ack the message, store the result (a task).
Finish = Callable[[RequestResult, str, Msg | None], None]
# post(event): hand a request taken in to the scheduler's inbox.
Post = Callable[[TakenIn], Awaitable[None]]


class _Peek(msgspec.Struct):
    """What can be read from a malformed image request to answer it: its id and tenant."""

    request_id: str = ""
    tenant: str = ""


def _peek(data: bytes) -> _Peek:
    try:
        return msgspec.json.decode(data, type=_Peek)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return _Peek()


class Intake:
    def __init__(
        self,
        *,
        nc: Client,
        redis: Redis,
        keys: Keys,
        subjects: Subjects,
        registry: RegistryClient,
        cfg: SchedulerConfig,
        finish: Finish,
        post: Post,
    ) -> None:
        self.nc = nc
        self.redis = redis
        self.keys = keys
        self.subjects = subjects
        self.registry = registry
        self.cfg = cfg
        self.finish = finish
        self.post = post
        # request id -> the newest handle of its intake message, from the moment it is taken in
        # until it is answered (kept alive with in_progress meanwhile; acked when it ends)
        self.handles: dict[str, Msg] = {}
        self.taking: dict[str, asyncio.Task] = {}  # request id -> its take-in, retrying
        self._seq = 0  # arrival order of messages at this scheduler
        self.epoch = 0  # the scheduler's lease epoch, sent with its releases (fencing)

    @property
    def pending(self) -> int:
        """Requests being taken in (not yet queued nor in the core, not answered)."""
        return len(self.taking)

    async def on_batch(self, msgs: list[Msg]) -> None:
        """Take a fetched batch in, in order. Every message is registered first, so the progress
        loop keeps all of them alive while the ones before them are being taken in."""
        accepted = []
        slices = TimeSlice()  # a batch is up to 128 requests, each unrolled: the loop runs between
        for m in msgs:
            await slices.check()
            try:
                if (req := await self._accept(m)) is not None:
                    self._seq += 1
                    accepted.append((req, self._seq))
            except Exception:
                log.exception("intake of a message failed")
        await self._prefetch([req for req, _ in accepted])
        checked: list[tuple[ImageRequest, Dag, Deadline, int]] = []
        for req, seq in accepted:
            await slices.check()
            try:
                if (ok := await self._take_in(req, seq)) is not None:
                    checked.append((req, *ok, seq))
            except Exception as e:  # noqa: BLE001 - a bug: answered rather than kept alive for ever
                self._fail_permanently(req, e)
        if checked:
            await self._enqueue_many(checked)

    async def _prefetch(self, reqs: list[ImageRequest]) -> None:
        """Read the stored state of a batch's requests in one pipeline (``_take`` uses it instead of
        one round trip each: the take-in is sequential, so its round trips bound the intake rate)."""
        self._states = {}
        if len(reqs) < 2:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for req in reqs:
                pipe.hgetall(self.keys.request(req.request_id))
            states = await pipe.execute()
        except Exception as e:  # noqa: BLE001 - each take-in reads its own state instead
            log.debug("prefetching request state failed: %s", e)
            return
        self._states = {req.request_id: st for req, st in zip(reqs, states, strict=True)}

    async def _accept(self, m: Msg) -> ImageRequest | None:
        """The request to take in, registered with its handle; None when there is nothing to take
        in (malformed: answered or dropped; or a redelivery of one in hand: its newest handle kept)."""
        req = await self._decode(m)
        if req is None:
            return None
        rid = req.request_id
        if rid in self.handles:  # redelivered while taken in or in progress: keep the newest handle
            self.handles[rid] = m
            return None
        self.handles[rid] = m
        return req

    async def _take_in(self, req: ImageRequest, seq: int) -> tuple[Dag, Deadline] | None:
        """Check ``req`` (``_check``); its DAG and deadline when it is to be queued (by the batch:
        ``_enqueue_many``), None when it was answered or is being retried."""
        rid = req.request_id
        deadline = deadline_of(req, wall=time.time(), now=time.monotonic())
        if deadline.skew:
            log.warning("request %s: %s; its deadline counts from now", rid, deadline.skew)
        if self.taking:  # something is retrying: do not queue behind it
            self._keep_taking(req, deadline, None, seq)
            return None
        try:
            dag = await self._check(req, deadline)
        except Exception as e:  # noqa: BLE001 - classified: transient ones are retried
            if not is_transient(e):
                self._fail_permanently(req, e)
            else:
                self._keep_taking(req, deadline, e, seq)
            return None
        if dag is None:
            return None
        return dag, deadline

    async def _enqueue_many(self, items: list[tuple[ImageRequest, Dag, Deadline, int]]) -> None:
        """Count the attempts of a batch's checked requests up in one pipeline, and queue them."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for req, *_ in items:
                pipe.hincrby(self.keys.request(req.request_id), "attempt", 1)
            attempts = await pipe.execute()
        except Exception as e:  # noqa: BLE001 - classified: transient ones are retried one by one
            for req, _, deadline, seq in items:
                if not is_transient(e):
                    self._fail_permanently(req, e)
                else:
                    self._keep_taking(req, deadline, e, seq)
            return
        for (req, dag, deadline, seq), attempt in zip(items, attempts, strict=True):
            await self._enqueue(req, dag, deadline, seq, int(attempt))

    def _keep_taking(self, req: ImageRequest, deadline: Deadline, error: Exception | None, seq: int) -> None:
        task = asyncio.create_task(self._retry(req, deadline, error, seq))
        self.taking[req.request_id] = task

    async def _retry(self, req: ImageRequest, deadline: Deadline, error: Exception | None, seq: int) -> None:
        rid = req.request_id
        bind_request(rid)  # a task per request: its log lines carry the request id
        backoff = Backoff(self.cfg.retry_initial_s, self.cfg.retry_max_s)
        try:
            while True:
                now = time.monotonic()
                if error is not None:
                    if deadline.passed(now):
                        why = f"deadline passed while taking it in: {type(error).__name__}: {error}"
                        self._answer(req, failed(rid, why, "timeout"))
                        return
                    if backoff.tries % 10 == 0:
                        log.warning("taking %s in: %s: %s; retrying", rid, type(error).__name__, error)
                    await asyncio.sleep(min(backoff.next(), max(0.0, deadline.at - now)))
                try:
                    await self._take(req, deadline, seq)
                    return
                except Exception as e:  # noqa: BLE001 - classified below
                    if not is_transient(e):
                        self._fail_permanently(req, e)
                        return
                    error = e
        finally:
            self.taking.pop(rid, None)

    async def _take(self, req: ImageRequest, deadline: Deadline, seq: int) -> None:
        """One try at taking ``req`` in (into the backlog); raises what it could not get past
        (transient or a bug)."""
        dag = await self._check(req, deadline)
        if dag is not None:
            attempt = int(await self.redis.hincrby(self.keys.request(req.request_id), "attempt", 1))
            await self._enqueue(req, dag, deadline, seq, attempt)

    async def _check(self, req: ImageRequest, deadline: Deadline) -> Dag | None:
        """Everything before ``req`` is queued: its DAG, or None when it was answered instead (its
        result was stored, too many deliveries, past its deadline, a bad workflow); raises what it could not get past (transient or a bug)."""
        rid = req.request_id
        state = self._states.pop(rid, None)
        if state is None:
            state = await self.redis.hgetall(self.keys.request(rid))
        if state.get(b"status") in (b"succeeded", b"failed", b"cancelled") and b"result" in state:
            # Finished before a crash lost the ack: answer again instead of recomputing.
            await self.nc.publish(self.subjects.result(rid), state[b"result"])
            m = self.handles.pop(rid, None)
            if m is not None:
                await m.ack()
            return None
        if state.get(b"cancel"):  # cancelled before it was taken in (or before a fail-over)
            self._answer(req, cancelled(rid, state.get(b"cancel_reason", b"").decode(errors="replace")))
            return None
        m = self.handles.get(rid)
        if m is not None and (delivered := _delivered(m)) > self.cfg.max_deliveries:
            error = f"delivered {delivered} times without an answer (schedulers crashed on it or lost it)"
            self._answer(req, failed(rid, error, "internal"))
            return None
        if deadline.passed(time.monotonic()):
            late = time.monotonic() - deadline.at
            why = f"deadline passed before it was taken in ({req.timeout_s:g}s after submission, {late:.1f}s ago)"
            self._answer(req, failed(rid, why, "timeout"))
            return None
        try:
            spec = await self.registry.get(req.workflow, req.version, request_id=rid)
            return unroll(spec, resolve_params(spec, req.params))
        except (WorkflowNotFound, ParamError) as e:
            self._answer(req, failed(rid, str(e), "bad_params" if isinstance(e, ParamError) else "workflow"))
            return None
        except (T2IError, msgspec.ValidationError) as e:
            if is_transient(e):
                raise
            self._answer(req, failed(rid, f"workflow {req.workflow!r} cannot run: {e}", "workflow"))
            return None

    async def _enqueue(self, req: ImageRequest, dag: Dag, deadline: Deadline, seq: int, attempt: int) -> None:
        """Queue a checked request for admission, as its ``attempt`` (counted up in Redis)."""
        if attempt > 1:
            # A previous scheduler worked on this request: free whatever it left on executors.
            await self.nc.publish(
                self.subjects.executors_all, encode(ReleaseRequest(req.request_id, -1, epoch=self.epoch))
            )
        await self.post(TakenIn(Queued(seq, req, dag, attempt, deadline.at)))

    def _fail_permanently(self, req: ImageRequest, e: Exception) -> None:
        log.error("taking %s in failed: %s: %s", req.request_id, type(e).__name__, e, exc_info=e)
        self._answer(req, failed(req.request_id, f"internal error: {type(e).__name__}: {e}", "internal"))

    def _answer(self, req: ImageRequest, result: RequestResult) -> None:
        self.finish(result, req.tenant, self.handles.pop(req.request_id, None))

    async def _decode(self, m: Msg) -> ImageRequest | None:
        """The request, or None when it cannot be taken in (answered, or dropped without an id)."""
        try:
            req = intake_decoder.decode(m.data)
        except msgspec.DecodeError as e:
            peek = _peek(m.data)
            rid, tenant, problem = peek.request_id, peek.tenant, f"malformed image request: {e}"
        else:
            if REQUEST_ID.match(req.request_id) and req.tenant:
                return req
            rid, tenant, problem = req.request_id, req.tenant, "an image request without a tenant"
        if not REQUEST_ID.match(rid):
            log.error("dropped an image request with no usable id (%r): %s", rid[:100], problem)
            await m.term()
            return None
        log.error("request %s cannot be taken in: %s", rid, problem)
        self.finish(failed(rid, problem, "internal"), tenant, m)
        return None


def _delivered(m: Msg) -> int:
    try:
        return int(m.metadata.num_delivered)
    except Exception:  # noqa: BLE001 - not a JetStream message (tests): its first delivery
        return 1
