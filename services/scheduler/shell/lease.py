"""The scheduler lease: at most one scheduler of a namespace leads (``docs/scheduling.md``, "Fail-over").

The lease is one Redis key (``{ns}:scheduler:lease``) holding the leader's id with a TTL. It is
taken with ``SET NX PX`` and, in the same script, the fencing token ``{ns}:scheduler:epoch`` is
incremented: every acquisition gets a higher epoch than any before. The leader renews it every
``ttl/3`` with a compare-and-set script (only while it is still its own) and deletes it (again only
if its own) on a clean stop. The epoch goes with everything the leader does that a replaced leader
must not do: executors refuse dispatches with a lower one, the vTime script refuses writes.

The lease is kept by **a thread of its own, with its own Redis connection**, not by a task on the
scheduler's event loop: a loop that stalls (a large scheduling round, a slow callback, a CPU-starved
container) must not make a healthy leader miss its renewal and step down. The thread polls for the
lease while a standby, renews it while leading, and publishes ``valid_until``; the loop reads it
(:meth:`Lease.valid`) before every dispatch and vTime write and holds them back while it has passed
(:meth:`Lease.wait_valid`: the next renewal makes it valid again). The loop is told the lease is lost
(``on_lost``) only when Redis says so — the renewal finds the key gone or another's — or when Redis
could not be reached for a whole TTL. A renewal that succeeds proves the key never left this holder
(only this holder sets its id, and only once), so a thread that was itself held up past
``valid_until`` (a paused process) renews and carries on if the key is still its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis

from libs.common.redis_conn import DELETE_IF_HELD, RENEW_IF_HELD
from libs.protocol.keys import Keys
from services.scheduler.shell.retrying import is_transient

log = logging.getLogger(__name__)

# KEYS: lease, epoch. ARGV: holder, ttl ms. The new epoch, or 0 when another holds the lease.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""

# How soon a failed renewal is tried again (at most), while the TTL has not run out.
_RETRY_S = 0.2


class LeaseLost(RuntimeError):
    """This scheduler is no longer the leader (or cannot tell): it must stop acting at once."""


class Lease:
    """The lease as one scheduler holds it: taken, renewed and given up by its keeper thread.

    ``connect`` makes the thread's Redis client (synchronous, its own connection; its socket
    timeouts should be well under the TTL so one hung call cannot outlast it). Read from the loop:
    ``epoch`` (the fencing token of this acquisition; 0 before), ``held``, ``valid_until``
    (monotonic: the lease may have expired in Redis from then on), :meth:`valid`.
    """

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        keys: Keys,
        ttl_s: float,
        poll_s: float = 0.5,
        holder: str | None = None,
    ) -> None:
        self._connect = connect
        self.keys = keys
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.epoch = 0
        self.held = False
        self.valid_until = 0.0
        self.polls = 0  # acquisitions tried as a standby
        self.renewals = 0  # successful renewals
        self.failed_renewals = 0  # renewals Redis did not answer (retried until the TTL runs out)
        self._stop = threading.Event()  # the keeper ends (giving the lease up if it holds it)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._acquired: asyncio.Future[None] | None = None
        self._renewed: asyncio.Event | None = None  # set (on the loop) after each renewal
        self._on_lost: Callable[[str], None] = lambda reason: None

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    # -- the loop's side --------------------------------------------------------------------------------
    def valid(self) -> bool:
        """Whether the lease is certainly still ours now: held, and renewed less than a TTL ago
        (counted from before the renewal was sent)."""
        return self.held and time.monotonic() < self.valid_until

    async def acquire(self, on_lost: Callable[[str], None]) -> None:
        """Start the keeper and wait (a standby) until it holds the lease. ``on_lost(reason)`` is
        called on this loop once, when the lease is lost; the keeper has then ended. Raises what
        made the keeper fail for good (say, a Redis user without the rights the lease needs)."""
        if self._thread is not None:
            raise RuntimeError("the lease keeper was started already")
        self._loop = asyncio.get_running_loop()
        self._acquired = self._loop.create_future()
        self._renewed = asyncio.Event()
        self._on_lost = on_lost
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.keys.ns}", daemon=True)
        self._thread.start()
        await asyncio.shield(self._acquired)

    async def wait_valid(self) -> None:
        """Return once :meth:`valid`, or once the lease is lost (check ``held`` after)."""
        assert self._renewed is not None, "acquire() first"
        while self.held and not self.valid():
            self._renewed.clear()
            if self.valid():  # renewed between the check and the clear
                return
            await self._renewed.wait()

    async def release(self) -> None:
        """End the keeper; it gives the lease up if it holds it (a clean stop: a standby takes over
        at its next poll). Safe to call twice, and before :meth:`acquire`."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self.ttl_s + 2.0)
        if self._acquired is not None and not self._acquired.done():
            self._acquired.cancel()

    # -- the keeper thread ------------------------------------------------------------------------------
    def _call_soon(self, fn: Callable[..., object], *args: object) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _keep(self) -> None:
        r = self._connect()
        try:
            if self._stand_by(r):
                self._renew_until_lost(r)
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which decides
            self._fail(e)
        finally:
            if self.held:  # stopped while leading: a clean stop hands the lease over at once
                self.held = False
                try:
                    r.eval(DELETE_IF_HELD, 1, self.keys.scheduler_lease, self.holder)
                except Exception as e:  # noqa: BLE001 - Redis away: the key expires by itself
                    log.warning("releasing the scheduler lease failed: %s: %s", type(e).__name__, e)
            r.close()

    def _fail(self, e: BaseException) -> None:
        acquired = self._acquired
        if acquired is not None and self.epoch == 0:  # still a standby: acquire() raises it

            def fail() -> None:
                if not acquired.done():
                    acquired.set_exception(e)

            self._call_soon(fail)
        else:
            log.error("the scheduler lease keeper failed", exc_info=e)
            self._lost(f"the lease keeper failed ({type(e).__name__}: {e})")

    def _stand_by(self, r: redis.Redis) -> bool:
        """Poll for the lease until taken (True) or stopped (False)."""
        said = False
        while not self._stop.is_set():
            sent = time.monotonic()
            self.polls += 1
            try:
                epoch = int(r.eval(_ACQUIRE, 2, self.keys.scheduler_lease, self.keys.scheduler_epoch,
                                   self.holder, self._ttl_ms))  # fmt: skip
            except Exception as e:
                if not is_transient(e):
                    raise
                log.warning("taking the scheduler lease failed: %s: %s", type(e).__name__, e)
                epoch = 0
            else:
                if epoch:
                    self.epoch, self.valid_until, self.held = epoch, sent + self.ttl_s, True
                    self._call_soon(self._taken)
                    return True
                if not said:
                    said = True
                    log.info(
                        "scheduler standby (namespace %s): the lease is held by %s; polling for it",
                        self.keys.ns, self._holder_now(r),
                    )  # fmt: skip
            self._stop.wait(self.poll_s)
        return False

    def _holder_now(self, r: redis.Redis) -> str:
        """Who holds the lease, for the standby's log line (whatever Redis answers)."""
        try:
            v = r.get(self.keys.scheduler_lease)
        except Exception as e:  # noqa: BLE001 - only a log line depends on it
            return f"(unknown: {type(e).__name__})"
        return "nobody" if v is None else v.decode(errors="replace")

    def _taken(self) -> None:
        if self._acquired is not None and not self._acquired.done():
            self._acquired.set_result(None)

    def _renew_until_lost(self, r: redis.Redis) -> None:
        """Renew every ttl/3 until stopped, or until the lease is lost (then ``on_lost``)."""
        wait = self.ttl_s / 3
        while not self._stop.wait(wait):
            sent = time.monotonic()
            try:
                ok = int(r.eval(RENEW_IF_HELD, 1, self.keys.scheduler_lease, self.holder, self._ttl_ms))
            except Exception as e:
                if not is_transient(e):
                    raise
                left = self.valid_until - time.monotonic()
                if left <= 0:
                    self._lost(
                        f"Redis could not be reached to renew the lease within its {self.ttl_s:g} s TTL"
                    )
                    return
                self.failed_renewals += 1
                log.warning("renewing the scheduler lease failed: %s: %s", type(e).__name__, e)
                wait = min(_RETRY_S, left)
                continue
            if not ok:
                self._lost("the lease is no longer ours (it expired, or another scheduler took it)")
                return
            late = sent - self.valid_until
            if late > 0:
                log.warning(
                    "renewed the scheduler lease %.2f s after it could have expired: still ours", late
                )
            self.valid_until = sent + self.ttl_s  # counted from before the call: never too late
            self.renewals += 1
            if self._renewed is not None:
                self._call_soon(self._renewed.set)
            wait = self.ttl_s / 3

    def _lost(self, reason: str) -> None:
        self.held = False
        self._call_soon(self._tell_lost, reason)

    def _tell_lost(self, reason: str) -> None:
        if self._renewed is not None:
            self._renewed.set()  # waiters see ``held`` false
        self._on_lost(reason)
