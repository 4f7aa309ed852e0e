"""Telling the registry which ModelFns this executor process can run (libs/protocol/adverts.py).

A plugin ModelFn package is installed in the executor image only; the registry learns its
signature from here. The advertisement is sent at start and every ``ttl_s / 3`` seconds after
(the registry forgets one not refreshed within ``ttl_s``); a registry that is not up yet, or a
lost reply, only delays it to the next round. :class:`WithCompanions` runs it (and the GPU lease)
alongside the executors as one service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import msgspec
from nats.aio.client import Client

from libs.common.service import Service, run_all
from libs.protocol.adverts import AdvertAck, ModelFnAdvert, advertise_subject
from libs.workflow.modelfn import Signature

log = logging.getLogger(__name__)


class Advertiser:
    def __init__(
        self,
        nc: Client,
        namespace: str,
        executor: str,
        signatures: Mapping[str, Signature],
        ttl_s: float = 300.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.nc = nc
        self.subject = advertise_subject(namespace)
        self.executor = executor
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.payload = msgspec.json.encode(
            ModelFnAdvert(
                executor=executor,
                signatures={n: msgspec.Raw(msgspec.json.encode(s)) for n, s in sorted(signatures.items())},
                ttl_s=ttl_s,
            )
        )
        self.acked = asyncio.Event()  # set once a registry stored an advertisement of ours

    async def advertise(self) -> AdvertAck | None:
        """Send it once; the registry's answer, or None when none came."""
        try:
            reply = await self.nc.request(self.subject, self.payload, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - no registry yet, or a lost reply: next round
            log.info("advertising ModelFns: no registry answered (%s); retrying", type(e).__name__)
            return None
        try:
            ack = msgspec.json.decode(reply.data, type=AdvertAck)
        except msgspec.DecodeError as e:
            log.warning("advertising ModelFns: bad reply %r (%s)", reply.data[:200], e)
            return None
        if not ack.ok:
            log.error("the registry refused our ModelFn advertisement: %s", ack.error)
        else:
            if ack.refused:
                log.error("the registry refused these ModelFn signatures: %s", ack.refused)
            if not self.acked.is_set():
                log.info("advertised %d ModelFns to the registry", len(ack.accepted))
            self.acked.set()
        return ack

    async def start(self) -> None:
        pass  # the first advertisement is run()'s: start must not wait for a registry

    async def run(self) -> None:
        delay = 0.5
        while True:
            ack = await self.advertise()
            if ack is not None and ack.ok:
                delay = self.ttl_s / 3
            else:
                delay = min(max(delay * 2, 0.5), 30.0, self.ttl_s / 3)
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        pass  # the registry forgets us after ttl_s; specs already stored stay valid


class WithCompanions:
    """A service run together with companions (the advertiser, the GPU lease): started after it,
    stopped before it in reverse order; the first of them all to end ends the process."""

    def __init__(self, main: Service, companions: Sequence[Service]) -> None:
        self.main = main
        self.companions = list(companions)

    async def start(self) -> None:
        await self.main.start()
        for c in self.companions:
            await c.start()

    async def run(self) -> None:
        await run_all(self.main.run(), *(c.run() for c in self.companions))

    async def stop(self) -> None:
        for c in reversed(self.companions):
            await c.stop()
        await self.main.stop()
