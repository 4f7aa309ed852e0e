"""The gateway's observability: Prometheus series of its own registry, and a clean log context.

Every HTTP request is counted and timed by route (the route's pattern, never the raw path: ids in
paths would make a series per call). aiohttp serves a keep-alive connection's requests one after
another in one task, so the log context (the request id :func:`libs.common.logs.bind_request`
binds in a handler) is cleared before and after each: a call's id never tags the next call's lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import structlog
from aiohttp import web

from libs.common.metrics import CONTENT_TYPE, GatewayMetrics, counter, gauge
from services.gateway.context import ADMISSION, METRICS, PROM

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def install(app: web.Application) -> GatewayMetrics:
    """The app's metrics (``app[PROM]``), with the in-flight gauges and the app's plain counters
    (``app[METRICS]``, bumped by the handlers) read at scrape time."""
    prom = GatewayMetrics()
    app[PROM] = prom

    def state() -> Iterator:
        admission = app[ADMISSION]
        yield gauge("t2i_gateway_inflight", "images in progress on this gateway", admission.inflight)
        per = gauge("t2i_gateway_tenant_inflight", "images in progress per tenant", labels=["tenant"])
        for tenant, n in sorted(admission.by_tenant.items()):
            per.add_metric([tenant], n)
        yield per
        for name, value in sorted(app[METRICS].items()):
            yield counter(f"t2i_gateway_{name}", f"gateway events: {name.replace('_', ' ')}", value)

    prom.add_state(state)
    return prom


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: counts every answer (errors included) and keeps the log context per request."""
    structlog.contextvars.clear_contextvars()
    t0 = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away first (nginx's code for it)
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        prom = request.app[PROM]
        method = request.method if request.method in METHODS else "other"  # clients pick any token
        prom.http(route, method, str(status)).inc()
        prom.http_seconds(route).observe(time.perf_counter() - t0)
        structlog.contextvars.clear_contextvars()


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the gateway's series in the Prometheus text format."""
    return web.Response(body=request.app[PROM].render(), headers={"Content-Type": CONTENT_TYPE})
