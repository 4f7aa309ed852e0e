"""The gateway as a service object: the aiohttp app (``app.py``) bound to a host and port.

The app owns its NATS/Redis connections through ``cleanup_ctx``, so tests can run it on a random
port with ``aiohttp_client``; this object only adds the listening socket and the common lifecycle.
"""

from __future__ import annotations

import logging

from aiohttp import web

from libs.common.service import run_forever

log = logging.getLogger(__name__)


class GatewayService:
    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        runner = web.AppRunner(self.app, access_log=None)
        self._runner = runner
        await runner.setup()  # runs the app's cleanup_ctx: connects NATS and Redis
        await web.TCPSite(runner, self.host, self.port).start()
        log.info("gateway listening on http://%s:%d", self.host, self.port)

    async def run(self) -> None:
        await run_forever()  # all work happens in the HTTP handlers

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
