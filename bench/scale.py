"""The control plane at scale (paper §8.5, "ServerlessT2I at scale"): 256 simulated GPUs, ~600
requests in flight.

The real gateway, registry and scheduler run as processes (``libs.launcher.Stack``), with 256
simulated executors (``--sim-procs`` processes) whose work is the ``paper-h800`` profile replayed at
a tiny time scale (``--scale``, 0.0005: a 21 ms DiT step sleeps 10 µs), so what is timed is the
control plane, not the "GPUs". The workload is the two simulated S1-like workflows
(``sd3-medium-like``, ``flux1-dev-like``: 31 nodes each, a 30-node critical path) over 8 tenants.
Requests enter through the gateway's HTTP API (``--via gateway``) or straight onto the JetStream
intake with the results read off the bus (``--via intake``), which leaves the gateway (and this
process' HTTP client) out; ``--via both`` measures both.

Two phases per entry path:

* **probe**: requests one at a time on the idle 256-GPU platform. A request's *added latency per
  node* is (end-to-end latency − its simulated work on the critical path) / the nodes on that
  path: what the control plane (intake, scheduling, dispatch round trips, completions, the result)
  adds per step of a DAG, the fixed per-request costs spread over its nodes.
* **load**: ``--inflight`` requests kept in flight (closed loop) until ``--requests`` are done.
  *Node dispatches per second* are the nodes of the requests that finished within the middle 80%
  of the run (by completion order), over that window's length. Beside the load, from 10% of it
  done until it ends, a light tenant's solo requests are probed the same way: the added latency
  per node and the overhead *under* the load (a request's own wait for a free GPU included, which
  the fair policy keeps short for a light tenant), printed as ``under the load``.

*Overhead* (the paper's: the share of total execution time the system adds): the p50 added latency
per node times the critical-path nodes, over the critical path's work at the profile's real speed
(H800 times, scale 1), summed over the workflows of the mix. It says how much longer a request
takes at real speed because of the control plane; the dispatch rate says whether the control plane
keeps up with 256 GPUs at all (``needed``: 256 / the mean node time of the mix).

Writes ``bench/results/scale.json``; the last three lines printed are ``N dispatches/s``,
``overhead X%`` and ``p50 added per node X ms`` (from the last entry path measured). ``--quick``
runs in under 3 minutes. Usage: ``python bench/scale.py [--quick] [--via gateway|intake|both]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from libs.launcher import brokers  # noqa: E402
from libs.launcher.stack import Stack  # noqa: E402
from libs.sim.profile import load_profile  # noqa: E402
from libs.sim.workflows import flux1_dev_like, sd3_medium_like  # noqa: E402
from libs.workflow.dag import TensorSource, unroll  # noqa: E402
from libs.workflow.params import resolve_params  # noqa: E402
from libs.workflow.spec import encode_spec  # noqa: E402

WORKFLOWS = {"sd3-medium-like": sd3_medium_like, "flux1-dev-like": flux1_dev_like}
TENANTS = [f"t{i}" for i in range(8)]
PROBE_TENANT = "probe"  # the probes during the load: a light tenant, as a newcomer's request is


def critical_path(spec, profile) -> tuple[int, float, int]:
    """(nodes on the critical path, its work in profile seconds, nodes in all) of one request."""
    dag = unroll(spec, resolve_params(spec, {"prompt": "x"}))
    best: dict[str, tuple[float, int]] = {}
    for nid, node in dag.nodes.items():  # topological order
        preds = {s.node for s in node.inputs.values() if isinstance(s, TensorSource)} | set(node.deps)
        work, n = max((best[p] for p in preds if p in best), default=(0.0, 0))
        best[nid] = (work + profile.model(node.model).exec_s.value, n + 1)
    work, nodes = max(best.values())
    return nodes, work, len(dag.nodes)


def loop_lag(stack: Stack) -> dict:
    """The scheduler's event-loop lag over the run (its watchdog's metrics, scraped; the stalls it
    reported, with the innermost frame of each blocking stack, from its log)."""
    import re
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    log_text = stack.read_log("scheduler")
    urls = re.findall(r"scheduler metrics on (http://\S+?/metrics)", log_text)
    if not urls:
        return {}
    with urllib.request.urlopen(urls[-1], timeout=10) as r:
        text = r.read().decode()
    buckets: list[tuple[float, float]] = []
    worst = count = full_gcs = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "t2i_scheduler_loop_lag_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "t2i_scheduler_loop_lag_seconds_count":
                count = sample.value
            elif sample.name == "t2i_scheduler_loop_lag_max_seconds":
                worst = sample.value
            elif sample.name == "python_gc_collections_total" and sample.labels.get("generation") == "2":
                full_gcs = sample.value
    buckets.sort()

    def over(bound: float) -> int:  # probes that waited longer than ``bound``
        at = [c for le, c in buckets if le == bound]
        return int(count - at[0]) if at else -1

    # Each reported stall: the innermost frame of the blocking stack (the log is JSON lines).
    where = []
    for line in log_text.splitlines():
        try:
            msg = str(json.loads(line).get("event", ""))
        except (json.JSONDecodeError, AttributeError):
            continue
        if "event loop blocked for over" in msg:
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', msg)
            where.append(":".join(frames[-1]) if frames else "?")
    return {
        "probes": int(count),
        "worst_s": worst,
        "over_10ms": over(0.01),
        "over_100ms": over(0.1),
        "over_500ms": over(0.5),
        "over_1s": over(1.0),
        "full_gc_collections": int(full_gcs),
        "reported_stalls": len(where),
        "reported_at": sorted({str(w) for w in where}),
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def broker_pids() -> dict[str, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            if comm in ("nats-server", "redis-server") and comm not in out:
                out[comm] = int(d.name)
    return out


class Client:
    """Sends one request and waits for its result, through the gateway or the intake."""

    def __init__(self, stack: Stack, via: str, versions: dict[str, int]) -> None:
        self.stack, self.via, self.versions = stack, via, versions
        self.http: aiohttp.ClientSession | None = None
        self.nc = None
        self.waiting: dict[str, asyncio.Future] = {}
        self.gpu_s: float | None = None

    async def __aenter__(self) -> Client:
        if self.via == "gateway":
            self.http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
            )
        else:
            import nats

            from libs.protocol.subjects import Subjects

            self.subjects = Subjects(self.stack.namespace)
            self.nc = await nats.connect(self.stack.nats_url)
            self.js = self.nc.jetstream()
            await self.nc.subscribe(self.subjects.result("*"), cb=self._on_result)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.http is not None:
            await self.http.close()
        if self.nc is not None:
            await self.nc.drain()

    async def _on_result(self, msg) -> None:
        import msgspec

        from libs.protocol.messages import RequestResult

        res = msgspec.json.decode(msg.data, type=RequestResult)
        fut = self.waiting.pop(res.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(res)

    async def one(self, workflow: str, tenant: str, seed: int) -> float | None:
        """Seconds end to end, or None when it failed (``self.gpu_s``: the executors' measured
        time of the last request, in profile seconds; None through the gateway)."""
        t0 = time.monotonic()
        if self.via == "gateway":
            assert self.http is not None
            async with self.http.post(
                f"{self.stack.url}/v1/images/generations",
                json={"model": workflow, "prompt": "a lighthouse", "seed": seed},
                headers={"Authorization": f"Bearer sk-{tenant}"},
            ) as resp:
                await resp.read()
                ok = resp.status == 200
        else:
            from libs.protocol.messages import ImageRequest, encode

            rid = "scale" + uuid.uuid4().hex
            fut = asyncio.get_running_loop().create_future()
            self.waiting[rid] = fut
            req = ImageRequest(
                request_id=rid,
                tenant=tenant,
                workflow=workflow,
                version=self.versions[workflow],
                params={"prompt": "a lighthouse", "seed": seed},
                submitted_at=time.time(),
                timeout_s=600.0,
            )
            await self.js.publish(self.subjects.intake, encode(req), headers={"Nats-Msg-Id": rid})
            res = await fut
            ok = res.status == "succeeded"
            self.gpu_s = res.gpu_s
        return time.monotonic() - t0 if ok else None


async def probe(
    client: Client,
    n: int,
    paths: dict[str, tuple[int, float, int]],
    scale: float,
    tenants: list[str] = TENANTS,
    until: asyncio.Event | None = None,
) -> dict:
    """``n`` requests one at a time (fewer if ``until`` is set first: the load they run beside ended)."""
    added: dict[str, list[float]] = {w: [] for w in WORKFLOWS}
    lat: dict[str, list[float]] = {w: [] for w in WORKFLOWS}
    net: list[float] = []  # added per node net of the executors' measured time (intake only)
    sent = 0
    for i in range(n):
        if until is not None and until.is_set():
            break
        sent += 1
        wf = list(WORKFLOWS)[i % len(WORKFLOWS)]
        t = await client.one(wf, tenants[i % len(tenants)], 1000 + i)
        if t is None:
            continue
        nodes, work, _ = paths[wf]
        lat[wf].append(t)
        added[wf].append((t - work * scale) / nodes)
        if client.gpu_s is not None:  # its critical path's share of what the executors measured
            net.append((t - client.gpu_s * scale * nodes / paths[wf][2]) / nodes)
    every = [x for xs in added.values() for x in xs]
    return {
        "requests": sent,
        "failed": sent - len(every),
        "added_per_node_ms": {"p50": 1e3 * pct(every, 0.5), "p99": 1e3 * pct(every, 0.99)},
        "net_of_executor_time_ms": {"p50": 1e3 * pct(net, 0.5), "p99": 1e3 * pct(net, 0.99)} if net else None,
        "by_workflow": {
            w: {
                "latency_ms_p50": 1e3 * pct(lat[w], 0.5),
                "added_per_node_ms_p50": 1e3 * pct(added[w], 0.5),
                "added_per_node_ms_p99": 1e3 * pct(added[w], 0.99),
            }
            for w in WORKFLOWS
        },
    }


async def load(
    client: Client,
    total: int,
    inflight: int,
    paths,
    pids: dict[str, int],
    probes: int = 0,
    scale: float = 1.0,
) -> dict:
    """The closed-loop load; with ``probes``, solo requests of a light tenant measured beside it
    (from 10% of the requests done until the load ends): added per node *under* the load."""
    done: list[tuple[float, int]] = []  # (completion time, nodes)
    ended, warm = asyncio.Event(), asyncio.Event()

    async def probing() -> dict | None:
        await warm.wait()
        return await probe(client, probes, paths, scale, [PROBE_TENANT], until=ended)

    failed = 0
    nxt = 0
    before = {name: cpu_ticks(pid) for name, pid in pids.items()}

    async def worker() -> None:
        nonlocal nxt, failed
        while nxt < total:
            i = nxt
            nxt += 1
            wf = list(WORKFLOWS)[i % len(WORKFLOWS)]
            t = await client.one(wf, TENANTS[i % len(TENANTS)], 10_000 + i)
            if t is None:
                failed += 1
            else:
                done.append((time.monotonic(), paths[wf][2]))
                if len(done) >= total // 10:
                    warm.set()

    t0 = time.monotonic()
    beside = asyncio.create_task(probing()) if probes else None
    await asyncio.gather(*(worker() for _ in range(inflight)))
    wall = time.monotonic() - t0
    ended.set()
    warm.set()
    under = await beside if beside is not None else None
    hz = os.sysconf("SC_CLK_TCK")
    cpu = {name: (cpu_ticks(pid) - before[name]) / hz / wall for name, pid in pids.items()}
    lo, hi = int(0.1 * len(done)), max(int(0.9 * len(done)) - 1, 0)
    window = done[hi][0] - done[lo][0] if hi > lo else 0.0
    nodes = sum(n for _, n in done[lo + 1 : hi + 1])
    return {
        "requests": total,
        "inflight": inflight,
        "failed": failed,
        "wall_s": wall,
        "dispatches_per_s": nodes / window if window > 0 else 0.0,
        "dispatches_per_s_whole_run": sum(n for _, n in done) / wall,
        "cpu_cores": {k: round(v, 3) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
        "probe_under_load": under,
    }


async def run_path(via: str, args, paths, nats_url: str, redis_url: str) -> dict:
    from tests.conftest import cleanup_namespace, free_port

    log_dir = REPO / "var" / "bench" / f"scale-{via}"
    shutil.rmtree(log_dir, ignore_errors=True)  # logs are appended to: this run's only
    stack = Stack(
        namespace="scale" + uuid.uuid4().hex[:6],
        log_dir=log_dir,
        model_root=REPO / "models",
        gateway_port=free_port(),
        executors=0,
        sim_executors=args.gpus,
        sim_processes=args.sim_procs,
        sim_profile="paper-h800",
        sim_time_scale=args.scale,
        sim_heartbeat_s=args.heartbeat_s,
        api_keys=",".join(["sk-admin=bench:admin", *(f"sk-{t}={t}" for t in [*TENANTS, PROBE_TENANT])]),
        nats_url=nats_url,
        redis_url=redis_url,
        scheduler_env={
            "T2I_SCHEDULER_HEARTBEAT_TIMEOUT_S": str(max(5.0, 10 * args.heartbeat_s)),
            "T2I_SCHEDULER_MAX_ACTIVE": str(max(1000, 2 * args.inflight)),
            "T2I_SCHEDULER_LOOP_REPORT_S": str(args.report_stall_ms / 1e3),
            # asyncio's debug mode logs each callback that runs longer than 100 ms (and slows all).
            **({"PYTHONASYNCIODEBUG": "1"} if args.asyncio_debug else {}),
        },
        gateway_env={
            "T2I_GATEWAY_MAX_INFLIGHT": "100000",
            "T2I_GATEWAY_TENANT_INFLIGHT": "100000",
            "T2I_GATEWAY_REQUEST_TIMEOUT_S": "3600",
        },
    )
    await asyncio.to_thread(stack.start)
    try:
        sims = [n for n in stack.procs if n.startswith("sim-executors")]
        deadline = time.monotonic() + 120
        while not all("executor ready" in stack.read_log(n) for n in sims):
            if time.monotonic() > deadline:
                raise RuntimeError("simulated executors not ready after 120 s")
            await asyncio.sleep(0.2)
        versions = {}
        for name, make in WORKFLOWS.items():
            status, body = await asyncio.to_thread(
                stack.http, "POST", "/v1/workflows", json.loads(encode_spec(make())), "sk-admin"
            )
            assert status == 201, body
            versions[name] = int(body.get("version", 1))
        await asyncio.sleep(2 * args.heartbeat_s + 0.5)  # every executor has heartbeated
        pids = {name: p.pid for name, p in stack.procs.items()} | broker_pids() | {"bench": os.getpid()}
        async with Client(stack, via, versions) as client:
            # Warm-up: models resident somewhere, estimates learnt, connections open.
            await asyncio.gather(*(client.one(w, t, 0) for w in WORKFLOWS for t in TENANTS))
            result = {"via": via, "probe": await probe(client, args.probes, paths, args.scale)}
            print(f"  [{via}] probe: {json.dumps(result['probe']['added_per_node_ms'])}", file=sys.stderr)
            result["load"] = await load(
                client, args.requests, args.inflight, paths, pids, probes=args.probes, scale=args.scale
            )
            print(f"  [{via}] load: {json.dumps(result['load'])}", file=sys.stderr)
            if args.probe_after:
                result["probe_after_load"] = await probe(client, args.probes, paths, args.scale)
        result["loop_lag"] = await asyncio.to_thread(loop_lag, stack)
        print(f"  [{via}] scheduler loop lag: {json.dumps(result['loop_lag'])}", file=sys.stderr)
        return result
    finally:
        await asyncio.to_thread(stack.stop)
        await cleanup_namespace(nats_url, redis_url, stack.namespace)


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def overhead(res: dict, paths, phase: str = "probe") -> float:
    """p50 added per node × critical-path nodes over the critical-path work at real speed (summed
    over the mix), as a percentage; ``phase``: the idle probes, or ``under_load``."""
    added = (res["load"]["probe_under_load"] if phase == "under_load" else res["probe"])["by_workflow"]
    extra = sum(added[w]["added_per_node_ms_p50"] / 1e3 * paths[w][0] for w in WORKFLOWS)
    work = sum(paths[w][1] for w in WORKFLOWS)
    return 100.0 * extra / work


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests (under 3 minutes)")
    ap.add_argument("--via", choices=("gateway", "intake", "both"), default="gateway")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--sim-procs", type=int, default=2, help="processes the simulated GPUs run in")
    ap.add_argument("--scale", type=float, default=0.0005, help="real seconds per profiled second")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="the simulated executors' heartbeat")
    ap.add_argument("--inflight", type=int, default=600)
    ap.add_argument("--requests", type=int, default=0, help="requests in the load phase")
    ap.add_argument("--probes", type=int, default=0, help="solo requests in the probe phase")
    ap.add_argument("--probe-after", action="store_true", help="probe again after the load")
    ap.add_argument(
        "--report-stall-ms",
        type=float,
        default=500.0,
        help="the scheduler logs the stack of any event-loop stall longer than this",
    )
    ap.add_argument(
        "--asyncio-debug",
        action="store_true",
        help="run the scheduler in asyncio's debug mode: each callback over 100 ms is logged",
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    args.requests = args.requests or (1200 if args.quick else 3000)
    args.probes = args.probes or (20 if args.quick else 60)

    profile = load_profile("paper-h800")
    paths = {w: critical_path(make(), profile) for w, make in WORKFLOWS.items()}
    nodes_mix = sum(p[2] for p in paths.values())
    mean_node_s = (
        sum(
            profile.model(n.model).exec_s.value
            for make in WORKFLOWS.values()
            for n in unroll(make(), resolve_params(make(), {"prompt": "x"})).nodes.values()
        )
        / nodes_mix
    )
    needed = args.gpus / mean_node_s
    nats_url, redis_url = "nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0"
    started = brokers.ensure_brokers(nats_url, redis_url, REPO / "var" / "bench", log=lambda *_: None)
    vias = ["gateway", "intake"] if args.via == "both" else [args.via]
    results = []
    try:
        for via in vias:
            t0 = time.monotonic()
            res = await run_path(via, args, paths, nats_url, redis_url)
            res["overhead_pct"] = overhead(res, paths)
            if res["load"].get("probe_under_load"):
                res["overhead_under_load_pct"] = overhead(res, paths, "under_load")
            res["overhead_by_workflow_pct"] = {
                w: 100.0 * res["probe"]["by_workflow"][w]["added_per_node_ms_p50"] / 1e3 * p[0] / p[1]
                for w, p in paths.items()
            }
            results.append(res)
            print(f"  [{via}] done in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    finally:
        brokers.stop(started)

    out = Path(args.out)
    doc = {
        "paper": "ServerlessT2I (arXiv 2607.26566) §8.5",
        "gpus": args.gpus,
        "sim_processes": args.sim_procs,
        "time_scale": args.scale,
        "inflight": args.inflight,
        "cpu_cores_on_machine": os.cpu_count(),
        "workflows": {
            w: {"critical_nodes": p[0], "critical_work_s": p[1], "nodes": p[2]} for w, p in paths.items()
        },
        "mean_node_s": mean_node_s,
        "dispatches_needed_per_s": needed,
        "definitions": {
            "added_per_node": "(end-to-end latency - simulated critical-path work) / critical-path nodes, solo requests",
            "probe_under_load": "added_per_node of solo requests of a light tenant sent one at a time beside the load"
            " (from 10% of it done until it ends), and the overhead from them",
            "dispatches_per_s": "nodes of the requests finished in the middle 80% of the load phase / its length",
            "overhead": "p50 added per node x critical-path nodes / critical-path work at H800 speed, over the mix",
            "net_of_executor_time": "as added_per_node, less the executors' own measured time (their sleeps last"
            " >= 1 ms: asyncio's epoll timeout is in ms), its critical-path share; intake path only",
        },
        "results": results,
    }
    write_json(out / "scale.json", doc)
    print(
        f"\n{args.gpus} simulated GPUs in {args.sim_procs} processes, time scale {args.scale:g}, "
        f"{args.inflight} requests in flight; mix {', '.join(WORKFLOWS)} "
        f"(critical paths {', '.join(f'{p[0]} nodes / {p[1]:.3f}s' for p in paths.values())})"
    )
    print(f"needed at real speed: {needed:.0f} dispatches/s (256 GPUs / {1e3 * mean_node_s:.1f} ms per node)")
    print(
        f"{'via':8s}{'disp/s':>9s}{'p50 ms/node':>13s}{'p99 ms/node':>13s}{'net p50':>9s}{'overhead':>10s}"
        "  busiest processes (cores)"
    )
    for r in results:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in list(r["load"]["cpu_cores"].items())[:5])
        a = r["probe"]["added_per_node_ms"]
        net = r["probe"]["net_of_executor_time_ms"]
        print(
            f"{r['via']:8s}{r['load']['dispatches_per_s']:9.0f}{a['p50']:13.2f}{a['p99']:13.2f}"
            f"{net['p50'] if net else float('nan'):9.2f}{r['overhead_pct']:9.1f}%  {cpu}"
        )
        under = r["load"].get("probe_under_load")
        if under and under["requests"] > under["failed"]:
            u = under["added_per_node_ms"]
            print(
                f"{'':8s}under the load ({under['requests'] - under['failed']} probes of tenant {PROBE_TENANT!r}): "
                f"p50 {u['p50']:.2f} ms/node, p99 {u['p99']:.2f}, overhead {r['overhead_under_load_pct']:.1f}%"
            )
        per = r["overhead_by_workflow_pct"]
        print(f"{'':8s}overhead per workflow: " + ", ".join(f"{w} {x:.1f}%" for w, x in per.items()))
        lag = r.get("loop_lag") or {}
        if lag:
            print(
                f"{'':8s}scheduler loop lag: worst {1e3 * lag['worst_s']:.0f} ms; of {lag['probes']} probes "
                f"{lag['over_100ms']} waited > 100 ms, {lag['over_500ms']} > 500 ms, {lag['over_1s']} > 1 s; "
                f"{lag['full_gc_collections']} full GC collections"
            )
    last = results[-1]
    print(f"results: {out / 'scale.json'}")
    print(f"{last['load']['dispatches_per_s']:.0f} dispatches/s")
    print(f"overhead {last['overhead_pct']:.1f}%")
    print(f"p50 added per node {last['probe']['added_per_node_ms']['p50']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
