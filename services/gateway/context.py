"""What the gateway's handlers share, as typed aiohttp application and request keys."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from libs.common.metrics import GatewayMetrics
from libs.common.settings import CommonSettings
from services.gateway.admission import Admission
from services.gateway.auth import ApiKeys, Principal
from services.gateway.bridge import Bridge
from services.gateway.config import GatewayConfig
from services.gateway.limits import TenantLimits
from services.gateway.records import Records
from services.gateway.webhooks import Webhooks

CONFIG = web.AppKey("config", GatewayConfig)
COMMON = web.AppKey("common", CommonSettings)
KEYS = web.AppKey("keys", ApiKeys)
BRIDGE = web.AppKey("bridge", Bridge)
RECORDS = web.AppKey("records", Records)
METRICS = web.AppKey("metrics", Counter)
PROM = web.AppKey("prom", GatewayMetrics)  # Prometheus series (observe.py)
ADMISSION = web.AppKey("admission", Admission)
LIMITS = web.AppKey("limits", TenantLimits)
DECODE_SLOTS = web.AppKey("decode_slots", asyncio.Semaphore)
KEY_TURNS = web.AppKey("key_turns", dict)  # (tenant, Idempotency-Key) -> its turn (idempotency.key_turn)
TASKS = web.AppKey("tasks", set)  # generation tasks that outlive their HTTP call
WEBHOOKS = web.AppKey("webhooks", Webhooks)
PRINCIPAL = web.RequestKey("principal", Principal)
