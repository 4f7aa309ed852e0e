"""A request's progress as its client sees it: denoising steps, and one event per finished node.

Clients watch a request through the Redis stream ``{ns}:events:{request_id}`` (the gateway relays
it as server-sent events, ``docs/gateway.md``): one ``node`` entry per accepted completion and a
last ``end`` entry. The core builds the node entries here, as plain dicts inside
:class:`AppendEvent` effects, and the shell's outbox writes them in the same pipeline as the request
state (the core stays I/O-free; the outbox stamps the wall-clock time ``t``). The ``end`` entry is
written with the result, so a request answered without reaching the core (cancelled while queued,
refused at intake) has one too.

*Steps.* A workflow's loop is unrolled into one node per iteration (``transformer@3``, nested:
``x@3.1``, ``libs/workflow/dag.py``). A denoising step is one iteration of a top-level loop: the
nodes sharing its index (the base model, its ControlNets, anything else in the body). A step has
finished when all of its nodes have; steps finish in order because each reads the last one's
latents. Two loops are told apart by their iteration counts (a base and a refiner loop of equal
length count as one loop whose step ends when both have done it: the bar still only moves forward).
A workflow without a loop has ``steps`` 0: its clients follow ``done``/``total`` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from libs.protocol.ids import split_node_id
from libs.protocol.messages import NodeComplete, RequestResult
from libs.workflow.dag import Dag
from services.scheduler.core.effects import AppendEvent

if TYPE_CHECKING:
    from services.scheduler.core.records import RequestRun

StepKey = tuple[int, str]  # (the loop's iteration count, the iteration's top-level index)


def step_units(dag: Dag) -> tuple[dict[str, StepKey], dict[StepKey, int]]:
    """Each looped node's step, and how many nodes each step has."""
    indices: dict[str, set[str]] = {}  # op id -> the top-level indices it was unrolled at
    split: dict[str, tuple[str, str]] = {}
    for nid in dag.nodes:
        base, loops = split_node_id(nid)
        if loops:
            idx = loops[0]
            split[nid] = (base, idx)
            indices.setdefault(base, set()).add(idx)
    step_of = {nid: (len(indices[base]), idx) for nid, (base, idx) in split.items()}
    sizes: dict[StepKey, int] = {}
    for key in step_of.values():
        sizes[key] = sizes.get(key, 0) + 1
    return step_of, sizes


def node_done(run: RequestRun, node_id: str) -> None:
    """Count a completed node towards its step."""
    key = run.step_of.get(node_id)
    if key is None:
        return
    left = run.step_left[key] - 1
    run.step_left[key] = left
    if left == 0:
        run.steps_done += 1


def recount(run: RequestRun) -> None:
    """Recompute the steps done from the nodes' states (after lineage re-execution undid some)."""
    left = dict(run.step_sizes)
    for nid, key in run.step_of.items():
        if run.nodes[nid].state.name == "DONE":
            left[key] -= 1
    run.step_left = left
    run.steps_done = sum(1 for n in left.values() if n == 0)


def charged_s(run: RequestRun) -> float:
    """Measured time of the nodes that ran, less lineage re-execution (the platform's loss)."""
    return max(0.0, run.gpu_s - run.rerun_s)


def node_event(run: RequestRun, msg: NodeComplete, fn: str, model: str) -> AppendEvent:
    t = msg.timing
    return AppendEvent(
        run.request_id,
        {
            "type": "node",
            "request_id": run.request_id,
            "node_id": msg.node_id,
            "fn": fn,
            "model": model,
            "executor": msg.executor,
            "done": run.nodes.done,
            "total": len(run.nodes),
            "step": run.steps_done,
            "steps": len(run.step_sizes),
            "gpu_s": round(charged_s(run), 6),
            "timing": {
                "load_s": t.load_s,
                "fetch_s": t.fetch_s,
                "exec_s": t.exec_s,
                "store_s": t.store_s,
                "load_tier": t.load_tier,
            },
        },
    )


def end_event(result: RequestResult) -> dict:
    """The stream's last entry: how the request ended (written with its result, ``service.py``:
    after every node event, since a result waits for the effects queued before it)."""
    return {
        "type": "end",
        "request_id": result.request_id,
        "status": result.status,
        "gpu_s": round(result.gpu_s, 6),
        "done": result.nodes_run,
        "total": result.nodes,
    }
