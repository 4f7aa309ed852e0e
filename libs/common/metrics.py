"""Prometheus metrics of every service (docs/observability.md), each in a registry of its own.

Each service object owns one ``*Metrics`` instance, and that instance owns its
``CollectorRegistry``: tests run several gateways, schedulers or executors in one process, and a
process-global registry would make their series collide (``Duplicated timeseries``) or mix. The
gateway serves its registry on its own port (``GET /metrics``); the scheduler, the registry and the
executors serve theirs with :func:`serve_metrics` on ``T2I_METRICS_PORT`` (0: a free port, whose
number is logged, the line's ``metrics_url``).

Hot paths observe through cached label children (:class:`_Children`): one dict lookup and one
locked add per observation, no label validation, so the scheduler's dispatch path stays cheap.
The scheduler's core never sees any of this: the shell observes the effects it carries out.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = [
    "ExecutorMetrics",
    "GatewayMetrics",
    "RegistryMetrics",
    "SchedulerMetrics",
    "ServiceMetrics",
    "serve_metrics",
]

log = logging.getLogger(__name__)

# No ``*_created`` series (a timestamp per labelled counter): scrapers do not need them, and they
# double what every scrape carries.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Node phases: a resident model's step takes milliseconds, a cold load of a large model minutes.
NODE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A whole image: tiny CPU models in a second, a large model from disk in minutes.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
TIERS = ("gpu", "host", "disk")
# An event loop's lag: a healthy loop answers a probe within a millisecond or two.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Children:
    """A labelled metric's children cached by label tuple (``labels()`` validates on every call)."""

    __slots__ = ("_metric", "_cache")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


class ServiceMetrics:
    """A service's registry and its exposition."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # Labelled series of this service's registry, each called with its label values.
    def counter(self, name: str, doc: str, labels: list[str]) -> _Children:
        return _Children(Counter(name, doc, labels, registry=self.registry))

    def gauge(self, name: str, doc: str, labels: list[str]) -> _Children:
        return _Children(Gauge(name, doc, labels, registry=self.registry))

    def histogram(self, name: str, doc: str, labels: list[str], buckets: Sequence[float]) -> _Children:
        return _Children(Histogram(name, doc, labels, buckets=buckets, registry=self.registry))


# -- gateway -------------------------------------------------------------------------------------------
class GatewayMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("gateway")

        self.http = self.counter(
            "t2i_gateway_http_requests", "HTTP requests answered", ["route", "method", "status"]
        )
        self.http_seconds = self.histogram(
            "t2i_gateway_http_request_seconds", "HTTP handling time", ["route"], buckets=HTTP_BUCKETS
        )
        self.calls = self.counter(
            "t2i_gateway_calls",
            "generation calls ended, by workflow, tenant and outcome",
            ["workflow", "tenant", "status"],
        )
        self.images = self.counter(
            "t2i_gateway_images", "images ended, by outcome", ["workflow", "tenant", "status"]
        )
        self.latency = self.histogram(
            "t2i_gateway_request_seconds",
            "a generation call's latency, from submission to its last image",
            ["workflow", "tenant", "status"],
            buckets=REQUEST_BUCKETS,
        )
        self.gpu_seconds = self.counter(
            "t2i_gateway_gpu_seconds", "GPU seconds charged to calls", ["workflow", "tenant"]
        )

    def call_ended(self, workflow: str, tenant: str, results: Iterable[Any], seconds: float) -> None:
        """One call's images ended (``results``: RequestResult or None per image)."""
        results = list(results)
        statuses = [getattr(res, "status", None) or "timeout" for res in results]
        for s in statuses:
            self.images(workflow, tenant, s).inc()
        status = next((s for s in statuses if s != "succeeded"), "succeeded")
        self.calls(workflow, tenant, status).inc()
        self.latency(workflow, tenant, status).observe(seconds)
        gpu = sum(getattr(res, "gpu_s", 0.0) or 0.0 for res in results)
        if gpu > 0:
            self.gpu_seconds(workflow, tenant).inc(gpu)

    def add_state(self, collect: Callable[[], Iterable[Any]]) -> None:
        """Series read from the app's state at scrape time (in-flight gauges, legacy counters)."""
        self.registry.register(_Callback(collect))


class _Callback:
    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self.collect = collect

    def describe(self) -> list:
        return []  # unchecked: the names are fixed and unique to the gateway


def gauge(name: str, doc: str, value: float | None = None, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=list(labels) or None)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


# -- scheduler -----------------------------------------------------------------------------------------
class SchedulerMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("scheduler")

        self.dispatches = self.counter(
            "t2i_scheduler_dispatches", "nodes dispatched to executors", ["workflow", "fn", "tenant"]
        )
        self.results = self.counter("t2i_scheduler_requests", "image requests ended", ["tenant", "status"])
        self.gpu = self.counter(
            "t2i_scheduler_gpu_seconds", "GPU seconds charged to ended requests", ["tenant"]
        )
        self.queue = Gauge(
            "t2i_scheduler_queue_depth",
            "requests waiting to start (backlog and core)",
            ["tenant"],
            registry=self.registry,
        )
        self.ready = Gauge(
            "t2i_scheduler_ready_nodes", "nodes ready to dispatch", ["tenant"], registry=self.registry
        )
        self.running = Gauge(
            "t2i_scheduler_running_nodes", "nodes running", ["tenant"], registry=self.registry
        )
        self.vtime = Gauge(
            "t2i_scheduler_vtime_seconds", "cumulative vTime (fair share)", ["tenant"], registry=self.registry
        )
        self.service_s = Gauge(
            "t2i_scheduler_service_seconds",
            "measured GPU seconds received",
            ["tenant"],
            registry=self.registry,
        )
        self.leading = Gauge(
            "t2i_scheduler_leading", "1 while this scheduler holds the lease", registry=self.registry
        )
        # The event loop's lag (libs/common/watchdog.py): how long ready work waited to run.
        self.loop_lag = Histogram(
            "t2i_scheduler_loop_lag_seconds",
            "how long a probe waited on the scheduler's event loop before it ran",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag_max = Gauge(
            "t2i_scheduler_loop_lag_max_seconds",
            "the longest the scheduler's event loop kept a probe waiting, since this reign began",
            registry=self.registry,
        )
        self._lag_max = 0.0
        # The cyclic GC's collections per generation: full ones are the loop's longest stalls
        # (services/scheduler/__main__.py, tune_gc).
        GCCollector(registry=self.registry)
        self._tenants: set[str] = set()

    def lagged(self, seconds: float) -> None:
        """The watchdog's probe waited ``seconds`` on the loop."""
        self.loop_lag.observe(seconds)
        if seconds > self._lag_max:
            self._lag_max = seconds
            self.loop_lag_max.set(seconds)

    def dispatched(self, d: Any) -> None:
        """A ``Dispatch`` went out (called by the shell per ``SendDispatch``)."""
        self.dispatches(d.workflow, d.fn, d.tenant).inc()

    def finished(self, result: Any, tenant: str) -> None:
        self.results(tenant or "-", result.status).inc()
        gpu = getattr(result, "gpu_s", 0.0)
        if gpu > 0:
            self.gpu(tenant or "-").inc(gpu)

    def tenants(self, view: Mapping[str, Mapping[str, float]], backlog: Mapping[str, int]) -> None:
        """The per-tenant view (refreshed every ``view_s``) and the intake backlog's counts."""
        seen = set(view) | set(backlog)
        for t in self._tenants - seen:  # a tenant that left: its gauges read 0, not their last value
            for g in (self.queue, self.ready, self.running):
                g.labels(t).set(0)
        self._tenants = seen
        for t in seen:
            v = view.get(t, {})
            self.queue.labels(t).set(v.get("queued", 0) + backlog.get(t, 0))
            self.ready.labels(t).set(v.get("ready_nodes", 0))
            self.running.labels(t).set(v.get("running_nodes", 0))
            if "vtime_s" in v:
                self.vtime.labels(t).set(v["vtime_s"])
                self.service_s.labels(t).set(v.get("service_s", 0.0))


# -- executor ------------------------------------------------------------------------------------------
class ExecutorMetrics(ServiceMetrics):
    """One per executor process (a simulated process runs many executors: the ``executor`` label
    tells them apart)."""

    def __init__(self) -> None:
        super().__init__("executor")

        def phase(name: str, what: str) -> _Children:
            return self.histogram(
                f"t2i_executor_node_{name}_seconds", what, ["fn", "executor"], buckets=NODE_BUCKETS
            )

        self.load = phase("load", "loading the node's model (0: resident)")
        self.fetch = phase("fetch", "pulling the node's inputs through the data plane")
        self.exec = phase("exec", "the ModelFn's execute()")
        self.store = phase("store", "writing outputs and uploading images")
        self.nodes = self.counter("t2i_executor_nodes", "nodes run, by outcome", ["fn", "executor", "status"])
        self.cache = self.counter(
            "t2i_executor_cache_hits",
            "where a node's model weights came from: gpu (resident), host (host tier), disk (a miss)",
            ["tier", "executor"],
        )
        self.busy_s = self.counter("t2i_executor_busy_seconds", "seconds spent running nodes", ["executor"])
        self.busy = self.gauge(
            "t2i_executor_busy_ratio",
            "share of the last heartbeat interval spent running nodes",
            ["executor"],
        )
        self._running: dict[str, tuple[float, str, str]] = {}  # executor -> (started, fn, model)
        self._window: dict[str, tuple[float, float]] = {}  # executor -> (window start, busy in it)
        self._per_node: dict[tuple[str, str], tuple] = {}

    def started(self, executor: str, fn: str, model: str, now: float | None = None) -> None:
        """``executor`` accepted a node of ``fn`` (on ``model``, "" for a model-less ModelFn)."""
        self._running[executor] = (time.monotonic() if now is None else now, fn, model)

    def ended(self, executor: str, status: str, timing: Any = None) -> str:
        """The node ``executor`` was running ended (``timing``: its ``NodeTiming`` when it
        succeeded); returns its fn ("" if none was started)."""
        now = time.monotonic()
        running = self._running.pop(executor, None)
        if running is None:
            return ""
        t0, fn, model = running
        load, fetch, exec_, store, ok, busy_s = self._node_children(fn, executor)
        busy_s.inc(now - t0)
        start, busy = self._window.get(executor, (t0, 0.0))
        self._window[executor] = (start, busy + now - max(t0, start))
        if timing is None:
            self.nodes(fn, executor, status).inc()
            return fn
        ok.inc()
        load.observe(timing.load_s)
        fetch.observe(timing.fetch_s)
        exec_.observe(timing.exec_s)
        store.observe(timing.store_s)
        if model:  # where its weights came from: resident (gpu), the host tier, or disk (a miss)
            self.cache(timing.load_tier or "gpu", executor).inc()
        return fn

    def _node_children(self, fn: str, executor: str) -> tuple:
        """A (fn, executor)'s children, looked up once: a node's metrics cost one dict lookup."""
        key = (fn, executor)
        found = self._per_node.get(key)
        if found is None:
            found = self._per_node[key] = (
                self.load(fn, executor),
                self.fetch(fn, executor),
                self.exec(fn, executor),
                self.store(fn, executor),
                self.nodes(fn, executor, "succeeded"),
                self.busy_s(executor),
            )
        return found

    def sample_busy(self, executor: str, now: float | None = None) -> float:
        """Set the busy ratio over the time since the last sample (called every heartbeat)."""
        now = time.monotonic() if now is None else now
        start, busy = self._window.get(executor, (now, 0.0))
        running = self._running.get(executor)
        t0 = running[0] if running is not None else None
        if t0 is not None:  # the running node's share of this window
            busy += now - max(t0, start)
        ratio = min(1.0, busy / (now - start)) if now > start else (1.0 if t0 is not None else 0.0)
        self.busy(executor).set(ratio)
        self._window[executor] = (now, 0.0)
        return ratio


# -- registry ------------------------------------------------------------------------------------------
class RegistryMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("registry")

        self.ops = self.counter("t2i_registry_ops", "registry requests answered", ["op", "status"])
        self.seconds = self.histogram(
            "t2i_registry_op_seconds", "registry request handling", ["op"], buckets=HTTP_BUCKETS
        )

    def op(self, op: str, status: int, seconds: float) -> None:
        self.ops(op, str(status)).inc()
        self.seconds(op).observe(seconds)


# -- serving -------------------------------------------------------------------------------------------
async def serve_metrics(stack: AsyncExitStack, metrics: ServiceMetrics, *, host: str, port: int) -> int:
    """Serve ``GET /metrics`` of ``metrics`` on ``host:port`` (0: a free port) until ``stack``
    unwinds; returns the bound port (``port`` < 0: not served, returns -1).

    The address is logged as the line's ``metrics_url`` field: with port 0 that line is how a test
    (or an operator) finds it; a deployment sets a fixed ``T2I_METRICS_PORT`` for its scraper."""
    if port < 0:
        log.info("metrics not served (T2I_METRICS_PORT=%d)", port)
        return -1
    from aiohttp import web

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise RuntimeError(f"T2I_METRICS_PORT: cannot listen on {host}:{port}: {e.strerror or e}") from None
    stack.push_async_callback(runner.cleanup)
    bound = runner.addresses[0][1]
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{bound}/metrics"
    structlog.get_logger(__name__).info(
        f"{metrics.service} metrics on {url}", metrics_url=url, pid=os.getpid()
    )
    return bound
