"""The observability building blocks: log format and request context, per-service registries."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common import logs
from libs.common.metrics import ExecutorMetrics, GatewayMetrics, SchedulerMetrics
from libs.common.settings import CommonSettings
from libs.protocol.messages import Dispatch, NodeTiming, RequestResult


def samples(metrics) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture
def json_log(monkeypatch):
    """Logging set up as a service does, in JSON, into a buffer; restored afterwards."""
    monkeypatch.setenv("T2I_LOG_FORMAT", "json")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logs.setup_logging("unit", "INFO")
    buf = io.StringIO()
    root.handlers[0].stream = buf
    yield buf
    root.handlers[:], level = saved
    root.setLevel(level)
    logging.captureWarnings(False)


def test_log_format_defaults_to_json_off_a_terminal_and_refuses_unknown_formats():
    assert logs.log_format({}, tty=False) == "json"
    assert logs.log_format({}, tty=True) == "console"
    assert logs.log_format({"T2I_LOG_FORMAT": "Console"}, tty=False) == "console"
    with pytest.raises(ValueError, match="T2I_LOG_FORMAT"):
        logs.log_format({"T2I_LOG_FORMAT": "xml"})


async def test_a_bound_request_id_tags_its_tasks_lines_and_no_others(json_log):
    log = logging.getLogger("unit.test")

    async def handle(rid: str) -> None:
        logs.bind_request(rid)
        await asyncio.sleep(0)
        log.info("working on %s", rid)
        await asyncio.to_thread(log.info, "in a thread")

    await asyncio.gather(asyncio.create_task(handle("aaaa-0")), asyncio.create_task(handle("bbbb-1")))
    log.info("outside")
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    by_event = {(x["event"], x.get("request_id")) for x in lines}
    assert ("working on aaaa-0", "aaaa-0") in by_event and ("working on bbbb-1", "bbbb-1") in by_event
    assert {x.get("call_id") for x in lines if x["event"] == "in a thread"} == {"aaaa", "bbbb"}
    (outside,) = [x for x in lines if x["event"] == "outside"]
    assert "request_id" not in outside and outside["service"] == "unit" and outside["level"] == "info"


def test_headers_rebind_the_request_id_per_message(json_log):
    log = logging.getLogger("unit.test")
    assert logs.bind_from_headers({logs.REQUEST_ID_HEADER: "cccc-2"}) == "cccc-2"
    log.info("first")
    assert logs.bind_from_headers(None) == ""
    log.info("second")
    first, second = (json.loads(line) for line in json_log.getvalue().splitlines())
    assert first["request_id"] == "cccc-2" and "request_id" not in second


def test_two_services_in_one_process_keep_their_series_apart():
    a, b = GatewayMetrics(), GatewayMetrics()
    ok = RequestResult(request_id="r-0", status="succeeded", gpu_s=1.5)
    a.call_ended("wf", "alice", [ok, None], 2.0)
    sa, sb = samples(a), samples(b)
    assert ({"workflow": "wf", "tenant": "alice", "status": "timeout"}, 1.0) in sa["t2i_gateway_calls_total"]
    assert ({"workflow": "wf", "tenant": "alice", "status": "succeeded"}, 1.0) in sa[
        "t2i_gateway_images_total"
    ]
    assert sa["t2i_gateway_gpu_seconds_total"] == [({"workflow": "wf", "tenant": "alice"}, 1.5)]
    assert "t2i_gateway_calls_total" not in sb


def test_scheduler_series_follow_dispatches_and_the_tenant_view():
    m = SchedulerMetrics()
    d = Dispatch("r-0", 0, "n", "alice", "sim.denoiser", "m", {}, [], workflow="wf")
    m.dispatched(d)
    m.dispatched(d)
    m.tenants(
        {"alice": {"vtime_s": 3.0, "service_s": 2.0, "queued": 1, "running_nodes": 1}}, {"alice": 2, "bob": 1}
    )
    s = samples(m)
    assert s["t2i_scheduler_dispatches_total"] == [
        ({"workflow": "wf", "fn": "sim.denoiser", "tenant": "alice"}, 2.0)
    ]
    assert ({"tenant": "alice"}, 3.0) in s["t2i_scheduler_queue_depth"]
    assert ({"tenant": "bob"}, 1.0) in s["t2i_scheduler_queue_depth"]
    assert s["t2i_scheduler_vtime_seconds"] == [({"tenant": "alice"}, 3.0)]
    m.tenants({}, {})  # both left: their gauges read 0
    assert {v for _, v in samples(m)["t2i_scheduler_queue_depth"]} == {0.0}


def test_executor_phases_cache_tiers_and_busy_ratio():
    m = ExecutorMetrics()
    m.started("e1", "sim.denoiser", "m", now=0.0)
    assert m.sample_busy("e1", now=0.0) == 1.0  # running, no time elapsed yet
    m.started("e1", "sim.denoiser", "m")
    m.ended("e1", "succeeded", NodeTiming(load_s=0.5, exec_s=0.1, load_tier="disk"))
    m.started("e1", "sim.denoiser", "m")
    m.ended("e1", "succeeded", NodeTiming(exec_s=0.1))
    s = samples(m)
    assert ({"fn": "sim.denoiser", "executor": "e1"}, 2.0) in s["t2i_executor_node_load_seconds_count"]
    assert ({"tier": "disk", "executor": "e1"}, 1.0) in s["t2i_executor_cache_hits_total"]
    assert ({"tier": "gpu", "executor": "e1"}, 1.0) in s["t2i_executor_cache_hits_total"]
    ratio = m.sample_busy("e1")
    assert 0.0 <= ratio <= 1.0
    assert m.sample_busy("e1") == 0.0  # idle since the last sample


def test_metrics_port_is_validated():
    assert CommonSettings(metrics_port=-1).metrics_port == -1
    with pytest.raises(ValueError, match="metrics_port"):
        CommonSettings(metrics_port=70000)
    with pytest.raises(ValueError, match="log_format"):
        CommonSettings(log_format="xml")
