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
| ``{ns}:scheduler:lease`` | string | the leading scheduler's holder id, with a TTL (``services/scheduler/shell/lease.py``) |
| ``{ns}:scheduler:epoch`` | string | the fencing token: incremented by every acquisition of the lease |
| ``{ns}:gw:gen:{generation_id}`` | string | the gateway's record of one call (``services/gateway/records.py``) |
| ``{ns}:gw:res:{request_id}`` | string | an image request's result, kept for the call's lifetime |
| ``{ns}:gw:recent[:{tenant}]`` | sorted set | recent calls of a tenant (of all tenants without one) |
| ``{ns}:gw:idem:{tenant}:{sha256}`` | string | an idempotency key (hashed) -> the call it made |
| ``{ns}:gw:model:{name}`` | string | the tenant that owns a workflow registered through the gateway |
| ``{ns}:modelfns:advertised`` | hash | ModelFn name -> the signatures executors advertise, with an expiry |
| ``{ns}:gpu:{scope}:{gpu}`` | string | the GPU lease of one GPU of a box (``libs/common/gpu_lease.py``) |
| ``{ns}:gpu:{scope}:nvshmem:generation`` | string | the box's current NVSHMEM world generation (``services/executor/world.py``) |
| ``{ns}:gpu:{scope}:nvshmem:{generation}`` | string | rank 0's unique id of that world (``libs/dataplane/transport/bootstrap.py``) |
| ``{ns}:gpu:{scope}:nvshmem:{generation}:gate`` | hash | that world's join gate: ``joined`` count, ``closed`` flag |

ACL key patterns (``libs/launcher/creds.py``) are built here too (``*_pattern``).
"""

from __future__ import annotations

import hashlib
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

    # -- the gateway's own records --------------------------------------------------------------
    @property
    def gateway_pattern(self) -> str:
        """Every key of the gateway's own records (an ACL key pattern)."""
        return f"{self.ns}:gw:*"

    def generation(self, generation_id: str) -> str:
        return f"{self.ns}:gw:gen:{generation_id}"

    def result(self, request_id: str) -> str:
        return f"{self.ns}:gw:res:{request_id}"

    def recent(self, tenant: str | None) -> str:
        """Recent calls of ``tenant``; of every tenant for None."""
        return f"{self.ns}:gw:recent" if tenant is None else f"{self.ns}:gw:recent:{tenant}"

    def idempotency(self, tenant: str, key: str) -> str:
        # The client's key is hashed: any bytes it sends stay out of the key space.
        return f"{self.ns}:gw:idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"

    def workflow_owner(self, name: str) -> str:
        return f"{self.ns}:gw:model:{name}"

    # -- the registry's ModelFn advertisements ---------------------------------------------------
    @property
    def modelfns_advertised(self) -> str:
        return f"{self.ns}:modelfns:advertised"

    # -- a box's GPUs ----------------------------------------------------------------------------
    @property
    def gpu_pattern(self) -> str:
        """Every GPU lease and NVSHMEM world key (the executors' ACL key pattern)."""
        return f"{self.ns}:gpu:*"

    def gpu_lease(self, scope: str, gpu: str) -> str:
        return f"{self.ns}:gpu:{scope}:{gpu}"

    @property
    def nvshmem_pattern(self) -> str:
        """Every box's NVSHMEM world keys (an ACL key pattern)."""
        return f"{self.ns}:gpu:*:nvshmem:*"

    def nvshmem_generation(self, scope: str) -> str:
        return f"{self.ns}:gpu:{scope}:nvshmem:generation"

    def nvshmem_world(self, scope: str, generation: int) -> str:
        return f"{self.ns}:gpu:{scope}:nvshmem:{generation}"

    def nvshmem_gate(self, scope: str, generation: int) -> str:
        return f"{self.nvshmem_world(scope, generation)}:gate"

    def pattern(self) -> str:
        """Matches every key of this namespace (tests delete them with it)."""
        return f"{self.ns}:*"
