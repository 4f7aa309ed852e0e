"""Observability across a process stack: Prometheus series and request-id-carrying JSON logs.

One call goes through a stack with simulated executors. Afterwards every service's ``/metrics`` —
the gateway's on its own port, the scheduler's, the registry's and the executors' on the free port
each logged (``metrics_url``) — is scraped over HTTP and parsed with prometheus_client's parser:
the series carry their workflow, tenant, ModelFn and executor labels with non-zero counts. Every
line each service logged is one JSON object, and each service logged a line carrying the call's
request id (the gateway's call id; the scheduler's, executors' and registry's image request id
``{call}-{i}``, with the call id as ``call_id``).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.support.stacks import sim_stack, started
from tests.support.waiting import until_sync

pytestmark = pytest.mark.timeout(150)

ADMIN_KEY = "sk-obs-ops"
USER_KEY = "sk-obs-alice"
API_KEYS = f"{ADMIN_KEY}=ops:admin,{USER_KEY}=alice"
WORKFLOW = "obs-wf"
SERVICES = ("gateway", "scheduler", "registry", "sim-executors")


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of the Prometheus text at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def log_lines(stack: Stack, name: str) -> list[dict]:
    """Every line of a service's log, each parsed as JSON (a line that is not fails the test)."""
    lines = [line for line in stack.read_log(name).splitlines() if line.strip()]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{name} logged a line that is not JSON: {line[:300]!r}")
    return parsed


def metrics_url(stack: Stack, name: str) -> str:
    urls = [x["metrics_url"] for x in log_lines(stack, name) if "metrics_url" in x]
    assert len(urls) == 1, f"{name} logged {len(urls)} metrics addresses\n{stack.tail(name)}"
    return urls[0]


def labelled(samples: dict, name: str, **want: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` whose labels include ``want``, with a non-zero value."""
    return [(labels, v) for labels, v in samples.get(name, []) if v > 0 and want.items() <= labels.items()]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, broker_urls) -> Stack:
    tmp = tmp_path_factory.mktemp("obs")
    stack = sim_stack(
        Path(tmp),
        api_keys=API_KEYS,
        sim_time_scale=0.01,
        # The sim executors log each node at DEBUG (at scale, INFO would flood the log).
        extra_env={"T2I_LOG_FORMAT": "json", "T2I_LOG_LEVEL": "DEBUG"},
    )
    with started(stack):
        spec = json.loads(encode_spec(sim_workflow(WORKFLOW, "sd3-medium", steps=3)))
        status, body = stack.http("POST", "/v1/workflows", spec, key=ADMIN_KEY)
        assert status == 201, body
        status, body = stack.http(
            "POST", "/v1/images/generations", {"model": WORKFLOW, "prompt": "a lighthouse"}, key=USER_KEY
        )
        assert status == 200, body
        stack.call_id = body["id"]  # type: ignore[attr-defined]
        yield stack


def test_the_gateway_counts_the_call_by_workflow_tenant_and_status(stack):
    m = scrape(stack.url + "/metrics")
    assert labelled(m, "t2i_gateway_calls_total", workflow=WORKFLOW, tenant="alice", status="succeeded")
    (_, count), *_ = labelled(
        m, "t2i_gateway_request_seconds_count", workflow=WORKFLOW, tenant="alice", status="succeeded"
    )
    assert count == 1
    assert labelled(m, "t2i_gateway_images_total", workflow=WORKFLOW, tenant="alice", status="succeeded")
    assert labelled(m, "t2i_gateway_gpu_seconds_total", workflow=WORKFLOW, tenant="alice")
    assert labelled(
        m, "t2i_gateway_http_requests_total", route="/v1/images/generations", method="POST", status="200"
    )
    assert ({}, 0.0) in m["t2i_gateway_inflight"]  # the call has ended


def test_the_scheduler_counts_dispatches_by_fn_and_tenants_vtime(stack):
    url = metrics_url(stack, "scheduler")
    m = scrape(url)
    dispatched = labelled(m, "t2i_scheduler_dispatches_total", workflow=WORKFLOW, tenant="alice")
    fns = {labels["fn"] for labels, _ in dispatched}
    assert len(fns) >= 3, fns
    # one text encoder, one latents preparation, 3 steps, one decoder
    assert sum(v for _, v in dispatched) == 6
    assert labelled(m, "t2i_scheduler_requests_total", tenant="alice", status="succeeded")
    assert labelled(m, "t2i_scheduler_gpu_seconds_total", tenant="alice")
    # The tenant gauges follow the operator view, refreshed every second (view_s).
    scraped = [m]

    def vtime_shown() -> bool:
        if not labelled(scraped[-1], "t2i_scheduler_vtime_seconds", tenant="alice"):
            scraped.append(scrape(url))
        return bool(labelled(scraped[-1], "t2i_scheduler_vtime_seconds", tenant="alice"))

    assert until_sync(vtime_shown, 10, step=0.2), scraped[-1].get("t2i_scheduler_vtime_seconds")
    m = scraped[-1]
    assert any(labels == {"tenant": "alice"} for labels, _ in m["t2i_scheduler_queue_depth"])
    assert m["t2i_scheduler_leading"] == [({}, 1.0)]


def test_the_executors_time_each_node_phase_by_fn_and_executor(stack):
    m = scrape(metrics_url(stack, "sim-executors"))
    ids = set(stack.executor_ids()["sim-executors"])
    ran = labelled(m, "t2i_executor_nodes_total", status="succeeded")
    assert {labels["executor"] for labels, _ in ran} <= ids
    assert sum(v for _, v in ran) == 6
    for phase in ("load", "fetch", "exec", "store"):
        counts = labelled(m, f"t2i_executor_node_{phase}_seconds_count")
        assert sum(v for _, v in counts) == 6, phase
        assert all(labels["fn"] and labels["executor"] in ids for labels, _ in counts)
    hits = labelled(m, "t2i_executor_cache_hits_total")
    assert {labels["tier"] for labels, _ in hits} <= {"gpu", "host", "disk"}
    assert sum(v for _, v in hits) == 6  # every node of this workflow has a model
    assert labelled(m, "t2i_executor_busy_seconds_total")
    assert {labels["executor"] for labels, _ in m["t2i_executor_busy_ratio"]} == ids


def test_the_registry_counts_its_operations(stack):
    m = scrape(metrics_url(stack, "registry"))
    assert labelled(m, "t2i_registry_ops_total", op="register", status="201")
    assert labelled(m, "t2i_registry_ops_total", op="get", status="200")
    assert labelled(m, "t2i_registry_op_seconds_count", op="get")


def test_every_service_logs_json_lines_and_one_carries_the_request_id(stack):
    call = stack.call_id
    for name in SERVICES:
        lines = log_lines(stack, name)
        assert all({"event", "level", "service", "timestamp"} <= line.keys() for line in lines), name
        mine = [x for x in lines if x.get("call_id") == call]
        assert mine, f"no line of {name} carries the call id {call}\n{stack.tail(name)}"
        ids = {x["request_id"] for x in mine}
        assert ids <= {call, f"{call}-0"}, (name, ids)
    # The scheduler's result line and an executor's node line name the image request.
    sched = [x for x in log_lines(stack, "scheduler") if x.get("request_id") == f"{call}-0"]
    assert any("succeeded" in x["event"] for x in sched)
    nodes = [x for x in log_lines(stack, "sim-executors") if x.get("request_id") == f"{call}-0"]
    assert any(x["event"].startswith("node ") for x in nodes)


def test_a_real_executor_times_its_nodes_and_logs_each_with_the_request_id(
    broker_urls, tiny_models, tmp_path
):
    """The same series from a real (torch, CPU) executor, whose node lines are logged at INFO."""
    from libs.models.flux_workflows import tiny_flux

    stack = sim_stack(
        tmp_path,
        api_keys=API_KEYS,
        model_root=tiny_models,
        executors=1,
        sim_executors=0,
        extra_env={"T2I_LOG_FORMAT": "json"},
    )
    with started(stack, timeout=120):
        status, body = stack.http(
            "POST", "/v1/workflows", json.loads(encode_spec(tiny_flux())), key=ADMIN_KEY
        )
        assert status == 201, body
        body_ = {"model": "tiny-flux", "prompt": "a lighthouse", "num_inference_steps": 2}
        status, body = stack.http("POST", "/v1/images/generations", body_, key=USER_KEY)
        assert status == 200, body
        m = scrape(metrics_url(stack, "executor-0"))
        ids = {f"{stack.namespace}-executor-0"}
        ran_on = labelled(m, "t2i_executor_nodes_total", status="succeeded")
        assert {labels["executor"] for labels, _ in ran_on} == ids
        ran = sum(v for _, v in ran_on)
        assert ran >= 5  # encoders, latents, 2 steps, decoder
        assert sum(v for _, v in labelled(m, "t2i_executor_node_exec_seconds_count")) == ran
        tiers = {labels["tier"] for labels, _ in labelled(m, "t2i_executor_cache_hits_total")}
        assert "disk" in tiers  # the first load of each model reads its checkpoint
        lines = [x for x in log_lines(stack, "executor-0") if x.get("call_id") == body["id"]]
        node_lines = [x for x in lines if x["event"].startswith("node ") and x["level"] == "info"]
        assert len(node_lines) == ran and {x["request_id"] for x in node_lines} == {body["id"] + "-0"}
