"""``python -m services.gateway``: the HTTP front door."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

from libs.common.config import load_config
from libs.common.logs import setup_logging
from libs.common.service import main
from libs.common.settings import common_settings
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService

log = logging.getLogger(__name__)


async def build(stack: AsyncExitStack) -> GatewayService:
    common = common_settings()
    cfg = load_config(GatewayConfig, "T2I_GATEWAY_")
    setup_logging("gateway", common.log_level)
    keys = ApiKeys.load(cfg.api_keys, cfg.api_keys_file)
    if not keys:
        log.warning("no API keys configured (T2I_GATEWAY_API_KEYS / _API_KEYS_FILE): every call will get 401")
    return GatewayService(make_app(cfg, common, keys), cfg.host, cfg.port)


if __name__ == "__main__":
    main(build)
