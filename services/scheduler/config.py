"""Scheduler settings (``T2I_SCHEDULER_*``)."""

from __future__ import annotations

import msgspec


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: str = "fair"  # "fair" (Algorithm 1), or the baselines "fifo", "sjf", "vtc"
    slack_s: float = 5.0  # the fair policy's Δ: vTime a tenant may lead the least-served one by
    tick_s: float = 0.2  # how often deadlines and executor liveness are checked
    heartbeat_timeout_s: float = 5.0  # an executor silent this long is gone
    dispatch_timeout_s: float = 2.0  # an executor that does not ack a dispatch this fast is suspect
    ack_wait_s: float = 30.0  # JetStream redelivers an intake message not acked/progressed this long
    max_active: int = 1000  # requests in progress before the scheduler stops taking more from intake
    max_node_retries: int = 2
    max_restarts: int = 2
    request_ttl_s: int = 86400  # how long request state stays in Redis after it ends
    view_s: float = 1.0  # how often the per-tenant operator view is refreshed in Redis
