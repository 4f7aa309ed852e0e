"""Every Redis key the platform writes, in one place (as arq keeps its prefixes together).

| key | type | holds |
|---|---|---|
| ``{ns}:wf:index`` | hash | workflow name -> latest version |
| ``{ns}:wf:{name}`` | hash | version -> spec JSON (immutable once written) |
| ``{ns}:loras`` | hash | LoRA name -> JSON {name, path, description} |
| ``{ns}:req:{request_id}`` | hash | request state: status, tenant, workflow, nodes done/total, step/steps, gpu_s, result, error, cancel |
| ``{ns}:events:{request_id}`` | stream | progress: one ``node`` entry per finished node, a last ``end`` entry (field ``data``: JSON; 1 h) |
| ``{ns}:cancels`` | sorted set | request id -> unix time its cancel was asked (the scheduler polls it, and trims it) |
| ``{ns}:executors`` | hash | executor id -> JSON operator view (kind, ModelFns, resident models, running, busy), refreshed each second |
| ``{ns}:tensors:{request_id}`` | hash | tensor id -> TensorMeta JSON of live intermediate tensors |
| ``{ns}:vtime`` | hash | tenant -> cumulative vTime (GPU seconds, estimates corrected, lifts) |
| ``{ns}:ops`` | hash | tenant -> dispatched ModelFn executions (the VTC baseline's counter) |
| ``{ns}:service`` | hash | tenant -> measured GPU seconds received (no estimates, no lifts) |
| ``{ns}:tenants`` | hash | tenant -> JSON operator view (vTime, service, queued/running), refreshed each second |
| ``{ns}:backlog`` | hash | tenant -> requests the scheduler took in and holds for admission (short TTL) |
| ``{ns}:gpu_s:{window_s}:{index}`` | hash | tenant -> measured GPU seconds charged in window ``index`` (TTL 2 windows) |
| ``{ns}:gw:quota:window_s`` | string | the GPU-second quota window (seconds), set by the gateway; the scheduler counts in it |
| ``{ns}:gw:limits:{tenant}`` | string | JSON per-tenant overrides of the gateway's limits (``queued``, ``gpu_s``), set by an admin |
| ``{ns}:scheduler:lease`` | string | the leading scheduler's holder id, with a TTL (``services/scheduler/lease.py``) |
| ``{ns}:scheduler:epoch`` | string | the fencing token: incremented by every acquisition of the lease |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    ns: str

    @property
    def workflow_index(self) -> str:
        return f"{self.ns}:wf:index"

    def workflow(self, name: str) -> str:
        return f"{self.ns}:wf:{name}"

    @property
    def loras(self) -> str:
        return f"{self.ns}:loras"

    def request(self, request_id: str) -> str:
        return f"{self.ns}:req:{request_id}"

    def events(self, request_id: str) -> str:
        return f"{self.ns}:events:{request_id}"

    @property
    def cancels(self) -> str:
        return f"{self.ns}:cancels"

    @property
    def executors_view(self) -> str:
        return f"{self.ns}:executors"

    def tensors(self, request_id: str) -> str:
        return f"{self.ns}:tensors:{request_id}"

    @property
    def vtime(self) -> str:
        return f"{self.ns}:vtime"

    @property
    def ops(self) -> str:
        return f"{self.ns}:ops"

    @property
    def service(self) -> str:
        return f"{self.ns}:service"

    @property
    def tenants(self) -> str:
        return f"{self.ns}:tenants"

    @property
    def backlog(self) -> str:
        return f"{self.ns}:backlog"

    def gpu_window(self, window_s: int, index: int) -> str:
        """Measured GPU seconds per tenant charged in window ``index`` (``time // window_s``)."""
        return f"{self.ns}:gpu_s:{window_s}:{index}"

    @property
    def gpu_window_pattern(self) -> str:
        """Every window's GPU-seconds hash (an ACL key pattern)."""
        return f"{self.ns}:gpu_s:*"

    @property
    def quota_window(self) -> str:
        return f"{self.ns}:gw:quota:window_s"

    def tenant_limits(self, tenant: str) -> str:
        return f"{self.ns}:gw:limits:{tenant}"

    @property
    def scheduler_lease(self) -> str:
        return f"{self.ns}:scheduler:lease"

    @property
    def scheduler_epoch(self) -> str:
        return f"{self.ns}:scheduler:epoch"

    def pattern(self) -> str:
        """Matches every key of this namespace (tests delete them with it)."""
        return f"{self.ns}:*"
