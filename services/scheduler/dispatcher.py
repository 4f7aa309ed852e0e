"""Sending dispatches and taking in their answers, without a task, future or timer per dispatch.

A dispatch is published to its executor's subject with a reply subject under one inbox of this
scheduler (``<inbox>.<token>``); the executor answers there with its ``Ack`` (``msg.respond``, as to
any request). One subscription to ``<inbox>.*`` takes in every answer, matched by its token to the
node and executor it is about, and hands it to the shell (``SchedulerService.on_dispatch_answer``).
A dispatch nobody answers within ``dispatch_timeout_s`` is found by one sweep (the pending
dispatches are kept in the order they were sent, so their deadlines are in order too); one sent to
a subject nobody listens on is answered at once by the server's no-responders status.

The executors see the same messages as with ``nc.request`` (the same subjects, the same reply
inbox prefix, so the same NATS permissions); the epoch fencing and a refusal's meaning are
unchanged (docs/scheduling.md, "Fail-over" and "Control-plane speed").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from libs.common.service import run_all
from libs.protocol.ids import NodeRef
from libs.protocol.messages import ack_decoder, encode
from services.scheduler.effects import SendDispatch

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"


class Dispatcher:
    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc
        self.pending: dict[str, tuple[NodeRef, str, float]] = {}  # token -> node, executor, deadline
        self._queue: list[SendDispatch] = []
        self._wake = asyncio.Event()
        self._inbox = ""
        self._next = 0

    async def start(self) -> None:
        """Subscribe to this scheduler's answers inbox (under the connection's inbox prefix)."""
        self._inbox = self.svc.nc.new_inbox()
        self.svc._subs.append(await self.svc.nc.subscribe(f"{self._inbox}.*", cb=self._on_answer))  # noqa: SLF001

    def send(self, e: SendDispatch) -> None:
        """Queue ``e``: everything queued by the time the sender wakes goes out together."""
        self._queue.append(e)
        self._wake.set()

    async def run(self) -> None:
        await run_all(self._send_loop(), self._sweep_loop())

    async def _send_loop(self) -> None:
        svc = self.svc
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not svc.lease.valid():  # not renewed for a TTL yet: sent once it is, or dropped
                await svc.lease.wait_valid()
            batch, self._queue = self._queue, []
            if not svc.leading:
                continue
            epoch = svc.epoch
            deadline = time.monotonic() + svc.cfg.dispatch_timeout_s
            for e in batch:
                token = str(self._next)
                self._next += 1
                node = e.msg.ref
                self.pending[token] = (node, e.executor, deadline)
                msg = msgspec.structs.replace(e.msg, epoch=epoch)
                try:
                    await svc.nc.publish(
                        svc.subjects.executor(e.executor), encode(msg), reply=f"{self._inbox}.{token}"
                    )
                except Exception as ex:  # noqa: BLE001 - the connection is away: as if unanswered
                    if self.pending.pop(token, None) is not None:
                        svc.on_dispatch_answer(node, e.executor, False, 0, f"no answer ({type(ex).__name__})")

    async def _sweep_loop(self) -> None:
        """Answer, as timed out, the dispatches older than ``dispatch_timeout_s`` (oldest first)."""
        every = min(0.1, self.svc.cfg.dispatch_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            while self.pending:
                token = next(iter(self.pending))
                node, executor, deadline = self.pending[token]
                if deadline > now:
                    break
                del self.pending[token]
                self.svc.on_dispatch_answer(node, executor, False, 0, "no answer (TimeoutError)")

    async def _on_answer(self, msg: Msg) -> None:
        found = self.pending.pop(msg.subject.rpartition(".")[2], None)
        if found is None:  # answered after its timeout (already treated as unanswered)
            return
        node, executor, _ = found
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS and not msg.data:
            self.svc.on_dispatch_answer(node, executor, False, 0, "no answer (NoRespondersError)")
            return
        try:
            ack = ack_decoder.decode(msg.data)
        except msgspec.DecodeError as ex:
            self.svc.on_dispatch_answer(node, executor, False, 0, f"malformed ack: {ex}")
            return
        self.svc.on_dispatch_answer(node, executor, ack.ok, ack.seq, ack.error)
