"""Sending dispatches and taking in their answers, without a task, future or timer per dispatch.

A dispatch is published to its executor's subject with a reply subject under one inbox of this
scheduler (``<inbox>.<token>``, the token the state machine gave it: ``SendDispatch.token``); the
executor answers there with its ``Ack`` (``msg.respond``, as to any request). One subscription to
``<inbox>.*`` takes in every answer and posts it to the scheduler's inbox as a
:class:`~services.scheduler.core.events.DispatchAnswer`. Timing out a dispatch nobody answers is the
machine's (``machine.py``, on its ticks); one sent to a subject nobody listens on is answered at
once by the server's no-responders status, and one whose deadline passed before it could be sent
(the lease not certainly valid meanwhile) is not sent.

The executors see the same messages as with ``nc.request`` (the same subjects, the same reply
inbox prefix, so the same NATS permissions); the epoch fencing and a refusal's meaning are
unchanged (docs/scheduling.md, "Fail-over" and "Control-plane speed").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from libs.protocol.messages import ack_decoder, encode
from libs.protocol.subjects import Subjects
from services.scheduler.core.effects import SendDispatch
from services.scheduler.core.events import DispatchAnswer
from services.scheduler.shell.lease import Lease

# post(event): hand an answer to the scheduler's inbox.
Post = Callable[[DispatchAnswer], Awaitable[None]]

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"


class Dispatcher:
    def __init__(
        self, *, nc: Client, subjects: Subjects, lease: Lease, leading: Callable[[], bool], post: Post
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.lease = lease
        self.leading = leading
        self.post = post
        self._queue: list[SendDispatch] = []
        self._wake = asyncio.Event()
        self._inbox = ""

    async def start(self) -> Subscription:
        """Subscribe to this scheduler's answers inbox (under the connection's inbox prefix)."""
        self._inbox = self.nc.new_inbox()
        return await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_answer)

    def send(self, e: SendDispatch) -> None:
        """Queue ``e``: everything queued by the time the sender wakes goes out together."""
        self._queue.append(e)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.lease.valid():  # not renewed for a TTL yet: sent once it is, or dropped
                await self.lease.wait_valid()
            batch, self._queue = self._queue, []
            if not self.leading():
                continue
            epoch = self.lease.epoch
            now = time.monotonic()
            if late := sum(e.deadline <= now for e in batch):
                log.warning("%d dispatches not sent: past their deadline while the lease was in doubt", late)
            for e in batch:
                if e.deadline <= now:  # the machine times it out (and sends the node elsewhere)
                    continue
                msg = msgspec.structs.replace(e.msg, epoch=epoch)
                try:
                    await self.nc.publish(
                        self.subjects.executor(e.executor), encode(msg), reply=f"{self._inbox}.{e.token}"
                    )
                except Exception as ex:  # noqa: BLE001 - the connection is away: as if unanswered
                    await self.post(DispatchAnswer(e.token, False, error=f"no answer ({type(ex).__name__})"))

    async def _on_answer(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        if not token.isdigit():
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS and not msg.data:
            await self.post(DispatchAnswer(int(token), False, error="no answer (NoRespondersError)"))
            return
        try:
            ack = ack_decoder.decode(msg.data)
        except msgspec.DecodeError as ex:
            await self.post(DispatchAnswer(int(token), False, error=f"malformed ack: {ex}"))
            return
        await self.post(DispatchAnswer(int(token), ack.ok, ack.seq, ack.error))
