"""``python -m services.gateway``: the HTTP front door."""

from __future__ import annotations

import asyncio

from aiohttp import web

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.runner import run_service
from libs.common.settings import common_settings
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig


async def main() -> None:
    common = common_settings()
    cfg = load_config(GatewayConfig, "T2I_GATEWAY_")
    log = setup_logging("gateway", common.log_level)
    keys = ApiKeys.load(cfg.api_keys, cfg.api_keys_file)
    if not keys:
        log.warning("no API keys configured (T2I_GATEWAY_API_KEYS / _API_KEYS_FILE): every call will get 401")
    runner = web.AppRunner(make_app(cfg, common, keys), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    log.info("gateway listening on http://%s:%d (namespace %s)", cfg.host, cfg.port, common.namespace)
    try:
        await run_service()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
