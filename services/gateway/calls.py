"""A generation call's life in one class: :class:`Call`.

One ``POST /v1/images/generations`` is one call: ``n`` image requests, one record in Redis
(``records.py``), one answer. Its routes (``routes/images.py``, ``routes/requests.py``) parse HTTP,
call a :class:`Call` method and turn what it returns into an HTTP answer. A synchronous call is
:meth:`~Call.create`, :meth:`~Call.submit`, :meth:`~Call.wait` and :meth:`~Call.answer`; an
asynchronous one (``Prefer: respond-async``) answers its :meth:`~Call.status` after submitting, as
``GET /v1/requests/{id}``, its event stream's ``done`` event and its webhook do later; a repeat with
the call's ``Idempotency-Key`` gets, from :meth:`~Call.create`, the earlier call, and answers what
its :meth:`~Call.replay` returns; :meth:`~Call.cancel` stops the images of a call that have not
ended, whoever asks (the tenant, or a synchronous client that hung up).

How the images' states combine into one status, the error an image's result answers with and the
call's ``usage`` are pure functions in ``results.py``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from libs.common.logs import bind_request
from libs.protocol.messages import ImageRequest, RequestResult
from libs.workflow.spec import WorkflowSpec
from services.gateway.context import (
    ADMISSION,
    BRIDGE,
    CONFIG,
    DECODE_SLOTS,
    LIMITS,
    METRICS,
    PROM,
    RECORDS,
    TASKS,
    WEBHOOKS,
)
from services.gateway.errors import ApiError
from services.gateway.formats import transcode
from services.gateway.generation import Generation, image_requests
from services.gateway.idempotency import being_set_up, check_repeat, key_turn
from services.gateway.inputs import resolve_inputs
from services.gateway.records import GenerationRecord, IdempotencyRecord, fingerprint
from services.gateway.results import call_status, error_of, usage_of

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
DISCONNECT_POLL_S = 0.25  # how often a synchronous call looks at its client's connection
SUBMIT_WAIT_S = 2.0  # a cancel waits this long for an image of the call to be submitted
CANCEL_WAIT_S = 5.0  # a cancel answers once its images ended, or after this long

Results = list[RequestResult | None]


@dataclass(frozen=True)
class Origin:
    """What building a call's ``data`` needs of the HTTP request that made it (image URLs are on
    its host), kept so a webhook sent after that request is gone builds the same URLs. Elsewhere
    the request itself is the origin."""

    scheme: str
    host: str


class Call:
    """One generation call, from its record in Redis (``rec``)."""

    def __init__(
        self,
        app: web.Application,
        rec: GenerationRecord,
        *,
        replayed: bool = False,
        key: str | None = None,
        claim: IdempotencyRecord | None = None,
        requests: list[ImageRequest] | None = None,
    ) -> None:
        self.app = app
        self.rec = rec
        self.replayed = replayed  # an earlier call, named by the Idempotency-Key of a repeat
        self._key = key
        self._claim = claim
        self._requests = requests  # to submit; None once submitted, or for an earlier call
        self._task: asyncio.Task[Results] | None = None

    @property
    def id(self) -> str:
        return self.rec.id

    @classmethod
    async def load(cls, app: web.Application, generation_id: str) -> Call | None:
        """The call recorded under ``generation_id``, if any (any tenant's: the caller checks)."""
        rec = await app[RECORDS].load(generation_id)
        return cls(app, rec) if rec is not None else None

    # -- create ---------------------------------------------------------------------------------------
    @classmethod
    async def create(
        cls,
        app: web.Application,
        tenant: str,
        spec: WorkflowSpec,
        gen: Generation,
        body: dict[str, Any],
        key: str | None,
        files: Mapping[str, bytes] | None = None,
    ) -> Call:
        """A new call of ``tenant``, admitted and recorded, that holds its admission slots until
        :meth:`submit` (call it at once) hands them to its task. With ``key``: when the tenant's key
        names a call already (this one's body must be the same: else 422), that call, ``replayed``
        and not to be submitted; nothing is admitted or recorded for it. ``files``: the image
        parameters an edit uploaded (checked PNGs; the body holds their digests)."""
        fp = fingerprint(body) if key else ""
        async with key_turn(app, tenant, key):
            held = await app[RECORDS].held(tenant, key) if key else None
            started = (
                held if held is not None else await cls._start(app, tenant, spec, gen, body, key, fp, files)
            )
        if isinstance(started, Call):
            return started
        return await cls._earlier(app, tenant, started, fp)

    @classmethod
    async def _start(
        cls,
        app: web.Application,
        tenant: str,
        spec: WorkflowSpec,
        gen: Generation,
        body: dict[str, Any],
        key: str | None,
        fp: str,
        files: Mapping[str, bytes] | None = None,
    ) -> Call | IdempotencyRecord:
        """Admit and record a new call; or, when a call elsewhere claimed ``key`` first, its
        idempotency record (this call's own record dropped, its slots freed)."""
        records = app[RECORDS]
        # Admitted before any heavy work (decoding control images): a tenant at its limit costs nothing.
        # The platform-wide limits (queued, GPU-second quota; limits.py) first, then this process's.
        await app[LIMITS].check(tenant, gen.n)
        admission = app[ADMISSION]
        admission.admit(tenant, gen.n)
        app[LIMITS].admitted(tenant, gen.n)
        gen_id = uuid.uuid4().hex[:20]
        bind_request(gen_id)  # this handler's and its tasks' log lines carry the call id
        claim = IdempotencyRecord(gen_id, fp) if key else None
        first: IdempotencyRecord | None = None
        try:
            loras = await resolve_inputs(
                spec, gen.params, body, app[BRIDGE], gen_id, app[DECODE_SLOTS], files
            )
            rec = GenerationRecord(
                id=gen_id,
                tenant=tenant,
                model=spec.name,
                created=int(time.time()),
                n=gen.n,
                response_format=gen.response_format,
                seeds=gen.seeds,
                timeout_s=app[CONFIG].request_timeout_s,
                loras=loras,
                output_format=gen.output_format,
                output_compression=gen.output_compression,
                size=gen.size,
            )
            reqs = image_requests(rec, spec, gen)
            await records.save(rec)
            if key and claim:
                first = await records.claim(tenant, key, claim)  # not None: another call got there first
        except BaseException:
            admission.release(tenant, gen.n)
            raise
        if first is not None:
            admission.release(tenant, gen.n)
            await records.drop(gen_id, tenant)
            return first
        return cls(app, rec, key=key, claim=claim, requests=reqs)

    @classmethod
    async def _earlier(cls, app: web.Application, tenant: str, held: IdempotencyRecord, fp: str) -> Call:
        """The call an idempotency key of ``tenant`` names, for a repeat whose body has ``fp``."""
        check_repeat(held, fp)
        rec = await app[RECORDS].load(held.generation_id)
        if rec is None or rec.tenant != tenant:
            raise being_set_up()
        return cls(app, rec, replayed=True)

    # -- submit ---------------------------------------------------------------------------------------
    def submit(self, origin: web.Request | Origin, webhook: str | None = None) -> None:
        """Publish the call's image requests and wait for their results in a task of its own, which
        frees the call's admission slots once they have ended; then deliver the call's final status
        to ``webhook`` (if it has one)."""
        assert self._requests is not None, "submitted already, or an earlier call"
        app, reqs = self.app, self._requests
        self._requests = None
        task = self._task = asyncio.create_task(self._run(reqs))
        app[TASKS].add(task)
        task.add_done_callback(lambda t: _task_done(app, t))
        if webhook:
            kept = Origin(origin.scheme, origin.host)
            task.add_done_callback(lambda t: self._deliver(t, kept, webhook))

    async def _run(self, reqs: list[ImageRequest]) -> Results:
        app, rec, key, claim = self.app, self.rec, self._key, self._claim
        bridge, records = app[BRIDGE], app[RECORDS]
        futures = [bridge.expect(r.request_id) for r in reqs]
        try:
            submitted = 0
            try:
                for req in reqs:
                    await bridge.submit(req)
                    submitted += 1
            except BaseException:
                if submitted == 0:  # nothing reached the scheduler: the key and the record are void
                    if key and claim:
                        await records.release(rec.tenant, key, claim)
                    await records.drop(rec.id, rec.tenant)
                raise
            app[METRICS]["images_requested"] += rec.n
            results = await asyncio.gather(
                *(bridge.wait(r.request_id, rec.timeout_s + 5, f) for r, f in zip(reqs, futures, strict=True))
            )
            await bridge.remember([r for r in results if r is not None])
            app[PROM].call_ended(rec.model, rec.tenant, results, time.time() - reqs[0].submitted_at)
            if key and claim and any(r is not None and r.error_code == "rate_limited" for r in results):
                # Answered 429 (worth retrying): a retry with the same key must be a new call, not
                # this answer again.
                await records.release(rec.tenant, key, claim)
            return list(results)
        finally:
            for r, f in zip(reqs, futures, strict=True):
                bridge.forget(r.request_id, f)
            app[ADMISSION].release(rec.tenant, rec.n)

    def _deliver(self, task: asyncio.Task, origin: Origin, webhook: str) -> None:
        if task.cancelled() or task.exception() is not None:  # shutting down, or nothing was submitted
            return

        async def body() -> bytes:
            return msgspec.json.encode(await self.status(origin))

        tasks = self.app[TASKS]
        delivery = asyncio.create_task(self.app[WEBHOOKS].deliver(webhook, self.id, body))
        tasks.add(delivery)
        delivery.add_done_callback(tasks.discard)

    # -- wait -----------------------------------------------------------------------------------------
    async def wait(self, gone: Callable[[], bool] | None = None) -> Results | None:
        """The results of the call's images.

        A call submitted here: its task's, which is never cancelled from here (it holds the call's
        admission slots until its images have ended, cancelled or not). With ``gone``, once it says
        the client went away the call is cancelled and None is returned. An earlier call (a
        replay): its results as they come, until its deadline.
        """
        assert self._requests is None, "not submitted yet"
        if self._task is None:
            return await self._attach()
        while True:
            done, _ = await asyncio.wait({self._task}, timeout=DISCONNECT_POLL_S)
            if done:
                return self._task.result()
            if gone is not None and gone():
                log.info("%s: the client disconnected; cancelling the call", self.id)
                try:
                    await self.cancel("the client disconnected", wait_s=0)
                except (ApiError, RedisError, OSError) as e:
                    log.warning("%s: cancelling after a disconnect failed: %s", self.id, e)
                return None

    async def _attach(self) -> Results:
        bridge, rec = self.app[BRIDGE], self.rec
        left = max(1.0, rec.created + rec.timeout_s + 5 - time.time())
        results = await asyncio.gather(*(bridge.wait(rid, left) for rid in rec.request_ids))
        # Kept as the first call's are: a lookup by id must then agree with this answer, even before
        # the scheduler has stored the results (it publishes them first).
        await bridge.remember([r for r in results if r is not None])
        return list(results)

    # -- cancel ---------------------------------------------------------------------------------------
    async def cancel(self, reason: str, wait_s: float = CANCEL_WAIT_S) -> None:
        """Cancel the call's images that have not ended (an image that ends meanwhile is left as it
        ended), then wait up to ``wait_s`` for them to end (a running image ends once its executors
        stopped)."""
        bridge, rec = self.app[BRIDGE], self.rec
        states = await bridge.states(rec.request_ids)
        pending = [rid for rid, s in zip(rec.request_ids, states, strict=True) if s.result is None]
        if not pending:
            return
        futures = {rid: bridge.expect(rid) for rid in pending} if wait_s > 0 else {}  # not missed
        try:
            await self._cancel_images(pending, reason)
        except BaseException:
            for rid, fut in futures.items():
                bridge.forget(rid, fut)
            raise
        log.info("%s: cancelling %d image request(s) for %s", rec.id, len(pending), rec.tenant)
        await asyncio.gather(*(bridge.wait(rid, wait_s, fut) for rid, fut in futures.items()))

    async def _cancel_images(self, request_ids: list[str], reason: str) -> None:
        """Ask the scheduler to cancel these image requests (idempotent there)."""
        bridge, tenant = self.app[BRIDGE], self.rec.tenant
        cancel = getattr(bridge, "cancel", None)
        if cancel is None:  # a scheduler bridge without cancellation
            raise ApiError(501, "cancelling is not supported by this gateway", code="not_supported")

        async def one(rid: str) -> None:
            # A call cancelled right after it was accepted may not have submitted this image yet (its
            # task does that): until the request exists there is nothing to flag, so look again.
            deadline = time.monotonic() + SUBMIT_WAIT_S
            while not await cancel(rid, tenant, reason):
                if await bridge.request_tenant(rid) is not None or time.monotonic() > deadline:
                    return  # it exists, so it ended (or is not the tenant's): nothing to cancel
                await asyncio.sleep(0.05)

        await asyncio.gather(*(one(rid) for rid in request_ids))

    # -- status ---------------------------------------------------------------------------------------
    async def status(self, origin: web.Request | Origin, with_data: bool = True) -> dict[str, Any]:
        """The call as ``GET /v1/requests/{id}`` shows it (also the 202 body, the SSE ``done`` event
        and the webhook body): its status from its images' (``results.call_status``), progress over
        nodes and denoising steps, ``usage``, and ``data`` once succeeded or ``error`` once failed or
        cancelled."""
        bridge, rec = self.app[BRIDGE], self.rec
        states, progress = await asyncio.gather(
            bridge.states(rec.request_ids), bridge.progress(rec.request_ids)
        )
        status = call_status(states)
        results = [s.result for s in states]
        out: dict[str, Any] = {
            "id": rec.id,
            "object": "image.generation.request",
            "created": rec.created,
            "model": rec.model,
            "status": status,
            "n": rec.n,
            "completed": sum(r is not None for r in results),
            "progress": progress,
            "usage": usage_of(results),
        }
        if status == "succeeded" and with_data:
            out["data"] = await self._items(origin, results, stale=True)  # type: ignore[arg-type]
        elif status in ("failed", "cancelled"):
            rid, ended = next(
                (r, s) for r, s in zip(rec.request_ids, states, strict=True) if s.status == status
            )
            err = error_of(ended.result, rid, rec.timeout_s, rec.loras)
            out["error"] = {**err.body(), "status": err.status}
        return out

    # -- answer and replay ----------------------------------------------------------------------------
    async def answer(self, origin: web.Request | Origin, results: Results, stale: bool) -> dict[str, Any]:
        """The body of the call's answer: its images; or, raised, the error of its first image that
        has none, which carries ``x-request-id`` too (a call that failed or timed out can be looked
        up later)."""
        rec = self.rec
        try:
            for rid, result in zip(rec.request_ids, results, strict=True):
                if result is None or result.status != "succeeded" or not result.images:
                    raise error_of(result, rid, rec.timeout_s, rec.loras)
            data = await self._items(origin, results, stale)  # type: ignore[arg-type]
        except ApiError as e:
            e.headers[REQUEST_ID_HEADER] = rec.id
            raise
        body = {
            "id": rec.id,
            "created": rec.created,
            "model": rec.model,
            "data": data,
            "output_format": rec.output_format,
            "usage": usage_of(list(results)),
        }
        if rec.size:
            body["size"] = rec.size
        return body

    async def replay(self, origin: web.Request | Origin, respond_async: bool) -> dict[str, Any]:
        """What a repeat of this (earlier) call with its ``Idempotency-Key`` answers: the call's
        answer, waiting for it if it is still running; or its status at once, for
        ``Prefer: respond-async``."""
        if respond_async:
            self.app[METRICS]["idempotent_replays"] += 1
            return await self.status(origin, with_data=False)
        results = await self._attach()
        self.app[METRICS]["idempotent_replays"] += 1
        return await self.answer(origin, results, stale=True)

    async def _items(
        self, origin: web.Request | Origin, results: list[RequestResult], stale: bool
    ) -> list[dict[str, Any]]:
        """The ``data`` of a call whose images all succeeded: a URL or the image itself (transcoded
        to the call's format) per image, with its seed. ``stale``: a lookup after the answer, where
        images past their hour are a 410 rather than an internal error."""
        app, rec = self.app, self.rec
        cfg, bridge = app[CONFIG], app[BRIDGE]
        data = []
        for rid, seed, result in zip(rec.request_ids, rec.seeds, results, strict=True):
            ref = next(iter(result.images.values()))
            item: dict[str, Any] = {}
            if rec.response_format == "url":
                base = cfg.public_url.rstrip("/") or f"{origin.scheme}://{origin.host}"
                name = ref.name.removesuffix(".png") + "." + rec.output_format  # the file route transcodes
                item["url"] = f"{base}/v1/images/files/{name}"
            else:
                png = await bridge.fetch_image(ref, delete=False)  # kept (1 h) for retries and lookups
                if png is None and stale:
                    raise ApiError(410, f"the images of {rec.id} have expired (kept 1 h)", code="expired")
                if png is None:
                    raise ApiError(500, f"image of {rid} is missing from the object store", code="internal")
                png = await transcode(png, rec.output_format, rec.output_compression, app[DECODE_SLOTS])
                item["b64_json"] = base64.b64encode(png).decode()
            if seed is not None:
                item["seed"] = seed
            data.append(item)
        return data


def _task_done(app: web.Application, task: asyncio.Task) -> None:
    app[TASKS].discard(task)
    if not task.cancelled() and task.exception() is not None:  # its call may have hung up: log it here
        log.warning("a generation failed: %r", task.exception())
