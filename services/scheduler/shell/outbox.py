"""Carrying out the scheduler core's effects, in batches (the shell's output side).

Everything queued when the loop wakes up goes out together: NATS messages are written one after
another (nats-py buffers them and its flusher sends them in one write), the request state of the
whole batch goes to Redis in one pipeline and its vTime changes in one fenced script call
(``VTimeStore.apply_many``), and a :class:`Flushed` marker is set once everything queued before it
has been carried out (a finished request's result waits on it: ``service.py``). The core stays
I/O-free; only this module batches (docs/scheduling.md, "Control-plane speed").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from redis.asyncio import Redis

from libs.protocol.keys import Keys
from libs.protocol.messages import LiveAttempts, ReleaseRequest, encode
from libs.protocol.subjects import Subjects
from libs.protocol.tensor_meta import TensorMeta
from services.scheduler.core.effects import (
    AppendEvent,
    BroadcastLive,
    ChargeVTime,
    Effect,
    PersistRequest,
    ReleaseAttempt,
    SendCallback,
    SendCancel,
)
from services.scheduler.shell.lease import Lease
from services.scheduler.shell.retrying import is_transient
from services.scheduler.shell.vtime_store import StaleEpoch, VTimeStore

log = logging.getLogger(__name__)

_ENDED = ("succeeded", "failed", "cancelled")
EVENTS_MAXLEN = 2000  # entries kept per request's progress stream (approximately: MAXLEN ~)
EVENTS_TTL_S = 3600

# Every progress entry of a batch in one call (ARGV: maxlen, ttl, then one entry per key): a
# pipelined XADD per completed node cost the scheduler, CPU-bound at 256 GPUs, about a fifth of its
# dispatch rate in client-side command packing and reply parsing.
_APPEND_EVENTS = """
for i, key in ipairs(KEYS) do
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*', 'data', ARGV[i + 2])
  redis.call('EXPIRE', key, ARGV[2])
end
return #KEYS
"""


# A batch's request state in one call per chunk of requests (KEYS: each request's state key and
# tensor-metadata key; ARGV: the TTL, then one JSON array with, per request, [its changed fields as
# a flat [name, value, ...] list, expire the state key (0/1), drop the tensors first (0/1), the
# tensors as a flat [id, metadata JSON, ...] list, expire the tensors key (0/1)]). Values are
# strings formatted here as redis-py formats them (Lua would print numbers with 14 digits). One
# argument encoded in C instead of a pipelined HSET/EXPIRE/DEL per request: packing those was a
# tenth of the scheduler's time at 64 simulated GPUs (docs/scheduling.md, "Control-plane speed").
_PERSIST = """
local ttl = ARGV[1]
local items = cjson.decode(ARGV[2])
for i, it in ipairs(items) do
  local key, tkey = KEYS[2 * i - 1], KEYS[2 * i]
  redis.call('HSET', key, unpack(it[1]))
  if it[2] == 1 then redis.call('EXPIRE', key, ttl) end
  if it[3] == 1 then redis.call('DEL', tkey) end
  if #it[4] > 0 then
    redis.call('HSET', tkey, unpack(it[4]))
    if it[5] == 1 then redis.call('EXPIRE', tkey, ttl) end
  end
end
return #items
"""

# A batch's request state goes out in script calls of this many requests, and its progress entries
# in script calls of this many: at 256 simulated GPUs, building one call for a whole batch was the
# longest callback on the event loop (100-370 ms under asyncio's debug mode, which runs about 3x
# slower: bench/scale.py --asyncio-debug); in pieces, the loop serves other work while Redis
# answers each. Order is kept: they go one after another.
_REQUESTS_PER_CALL = 200
_EVENTS_PER_CALL = 500


def _text(v: str | int | float) -> str:
    """A field value as redis-py would send it (``repr`` of a float: round-trip exact)."""
    return repr(v) if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class Flushed:
    """A marker in the effects queue: ``event`` is set when everything queued before it was done."""

    event: asyncio.Event


class Outbox:
    def __init__(
        self,
        *,
        nc: Client,
        redis: Redis,
        subjects: Subjects,
        keys: Keys,
        vtimes: VTimeStore,
        lease: Lease,
        request_ttl_s: int,
        leading: Callable[[], bool],
        step_down: Callable[[str], None],
    ) -> None:
        self.nc = nc
        self.redis = redis
        self.subjects = subjects
        self.keys = keys
        self.vtimes = vtimes
        self.lease = lease
        self.request_ttl_s = request_ttl_s
        self.leading = leading
        self.step_down = step_down
        self.queue: asyncio.Queue[Effect | Flushed] = asyncio.Queue(maxsize=100_000)
        # Request id -> the state fields this scheduler last wrote for it (until the request ends).
        self._written: dict[str, dict[str, str | int | float]] = {}
        self._tensors_ttl: set[str] = set()  # requests whose tensor metadata key has its TTL set

    async def run(self) -> None:
        """Carry out the queued effects in order, a batch at a time: everything queued when the
        loop wakes up goes out together — NATS messages written at once, request state and vTime
        changes in one Redis pipeline (one fenced script call for all the batch's changes) — and a
        ``Flushed`` marker is set once what was queued before it has been carried out."""
        while True:
            batch = [await self.queue.get()]
            while not self.queue.empty() and len(batch) < 5000:
                batch.append(self.queue.get_nowait())
            await self._carry_out(batch)

    async def _carry_out(self, batch: list[Effect | Flushed]) -> None:
        charges: list[ChargeVTime] = []
        persists: list[PersistRequest | AppendEvent] = []
        markers: list[asyncio.Event] = []
        for e in batch:
            if isinstance(e, Flushed):  # even when not leading: nothing waits on it for ever
                markers.append(e.event)
                continue
            if not self.leading():
                continue
            try:
                match e:
                    case ChargeVTime():
                        charges.append(e)
                    case PersistRequest() | AppendEvent():
                        persists.append(e)
                    case SendCallback(executor=ex, msg=ready):
                        await self.nc.publish(self.subjects.executor(ex), encode(ready))
                    case SendCancel(executor=ex, msg=cancel):
                        cancel = msgspec.structs.replace(cancel, epoch=self.lease.epoch)
                        await self.nc.publish(self.subjects.executor(ex), encode(cancel))
                    case ReleaseAttempt(attempt=ref):
                        release = ReleaseRequest(ref.request_id, ref.attempt, epoch=self.lease.epoch)
                        await self.nc.publish(self.subjects.executors_all, encode(release))
                    case BroadcastLive(attempts=live):
                        msg = LiveAttempts(live, epoch=self.lease.epoch)
                        await self.nc.publish(self.subjects.executors_all, encode(msg))
                    case _:
                        log.error("no handler for effect %r", e)  # a bug: every effect must be handled
            except Exception as ex:  # noqa: BLE001
                self._io_failed(type(e).__name__, ex)
        if self.leading() and (charges or persists):
            await self._write_state(charges, persists)
        for event in markers:
            event.set()

    async def _write_state(
        self, charges: list[ChargeVTime], persists: list[PersistRequest | AppendEvent]
    ) -> None:
        """Request state (one pipeline) and the vTime changes (one script call), concurrently:
        they touch different keys, and each keeps its own order."""
        jobs = []
        if persists:
            jobs.append(self._persist_many(persists))
        if charges:
            jobs.append(self._charge(charges))
        for what, res in zip(
            ["request state"] * bool(persists) + ["vTime"] * bool(charges),
            await asyncio.gather(*jobs, return_exceptions=True),
            strict=True,
        ):
            if isinstance(res, StaleEpoch):
                self.step_down(str(res))
            elif isinstance(res, BaseException):
                self._io_failed(what, res)

    async def _charge(self, charges: list[ChargeVTime]) -> None:
        """The vTime changes, once the lease is certainly ours (the script's epoch check is the
        safety net behind this); dropped if this scheduler steps down meanwhile."""
        lease = self.lease
        if not lease.valid():
            await lease.wait_valid()
            if not self.leading():
                return
        await self.vtimes.apply_many(charges)

    def _io_failed(self, what: str, ex: BaseException) -> None:
        if is_transient(ex):  # Redis or NATS briefly away: the in-memory state stays right
            log.warning("carrying out %s failed: %s: %s", what, type(ex).__name__, ex)
        else:
            log.error("carrying out %s failed", what, exc_info=ex)

    async def _persist_many(self, batch: list[PersistRequest | AppendEvent]) -> None:
        """The batch's request state, coalesced per request (the fields as the last of its effects
        left them, tensor metadata dropped and added in order), and only the fields that changed
        since this scheduler last wrote them: a completion usually changes 4 of 12. The first write
        of a request (status ``queued``: taken in or restarted), its end, and any write after a
        failed one write every field again. Progress events go into the same pipeline, in order."""
        merged: dict[str, tuple[dict, dict[str, TensorMeta], list[bool]]] = {}
        events: list[AppendEvent] = []
        for e in batch:
            if isinstance(e, AppendEvent):
                events.append(e)
                continue
            m = merged.get(e.request_id)
            if m is None:
                m = merged[e.request_id] = ({}, {}, [False])
            if e.fields.get("status") == "queued":
                self._written.pop(e.request_id, None)  # taken in or restarted: write it all
            m[0].update(e.fields)
            if e.drop_tensors:  # dropped first, then the effect's own tensors (if any) added
                m[1].clear()
                m[2][0] = True
            m[1].update(e.tensors)
        ttl = self.request_ttl_s
        stamp = time.time()
        updated = _text(stamp)
        pipe = self.redis.pipeline(transaction=False)
        keys: list[str] = []
        items: list[list] = []
        try:
            for rid, (fields, tensors, drop) in merged.items():
                last = self._written.get(rid)
                ending = fields.get("status") in _ENDED
                full = last is None or ending
                changed = fields if full else {k: v for k, v in fields.items() if last.get(k) != v}
                flat = [x for k, v in changed.items() for x in (k, _text(v))]
                flat += ("updated_at", updated)
                if ending:
                    self._written.pop(rid, None)
                    self._tensors_ttl.discard(rid)
                elif last is None:
                    self._written[rid] = fields
                else:
                    last.update(fields)
                if drop[0]:
                    self._tensors_ttl.discard(rid)
                metas = [x for tid, m in tensors.items() for x in (tid, msgspec.json.encode(m).decode())]
                expire_tensors = bool(tensors) and rid not in self._tensors_ttl  # once per key
                if expire_tensors:
                    self._tensors_ttl.add(rid)
                keys += (self.keys.request(rid), self.keys.tensors(rid))
                items.append([flat, int(full), int(drop[0]), metas, int(expire_tensors)])
                if len(items) == _REQUESTS_PER_CALL:  # sent now: the loop runs while Redis answers
                    pipe.eval(_PERSIST, len(keys), *keys, ttl, msgspec.json.encode(items))
                    await pipe.execute()
                    keys, items = [], []
            if items:
                # EVAL, not EVALSHA: see below.
                pipe.eval(_PERSIST, len(keys), *keys, ttl, msgspec.json.encode(items))
            t = round(stamp, 3)
            for ev in events:
                ev.data["t"] = t
            for i in range(0, len(events), _EVENTS_PER_CALL):
                chunk = events[i : i + _EVENTS_PER_CALL]
                # EVAL, not EVALSHA: a pipeline would check SCRIPT EXISTS first, which the
                # scheduler's Redis user may not run; Redis caches the compiled script either way.
                pipe.eval(
                    _APPEND_EVENTS,
                    len(chunk),
                    *(self.keys.events(ev.request_id) for ev in chunk),
                    EVENTS_MAXLEN,
                    EVENTS_TTL_S,
                    *(msgspec.json.encode(ev.data) for ev in chunk),
                )
                await pipe.execute()
            await pipe.execute()  # the rest (an empty pipeline sends nothing)
        except BaseException:
            for rid in merged:  # unknown what reached Redis: write these in full next time
                self._written.pop(rid, None)
                self._tensors_ttl.discard(rid)
            raise
