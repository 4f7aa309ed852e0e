"""Scheduler settings (``T2I_SCHEDULER_*``)."""

from __future__ import annotations

from typing import Literal

import msgspec


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True):
    # "fair" (Algorithm 1), or the baselines "fifo", "sjf", "vtc".
    policy: Literal["fair", "fifo", "sjf", "vtc"] = "fair"
    # "ours" (per-node dispatch), or the paper's baselines (§8.1) "nocache", "wcache", "mcache": each
    # request runs whole on one executor, held exclusively (deployment.py; docs/scheduling.md).
    # Its dispatches name it: executors cache weights at its granularity (unless
    # T2I_EXECUTOR_CACHE_MODE is set).
    deployment: Literal["ours", "nocache", "wcache", "mcache"] = "ours"
    slack_s: float = 5.0  # the fair policy's Δ: vTime a tenant may lead the least-served one by
    tick_s: float = 0.2  # how often deadlines and executor liveness are checked
    heartbeat_timeout_s: float = 5.0  # an executor silent this long is gone
    dispatch_timeout_s: float = 2.0  # an executor that does not ack a dispatch this fast is suspect
    # JetStream redelivers an intake message not acked/progressed this long: after a leader's crash,
    # the requests it held reach the new leader this long after its last keep-alive (fail-over).
    ack_wait_s: float = 6.0
    max_active: int = 1000  # requests in the core (the active set the policy sees) at most
    # Requests taken in beyond max_active, queued per tenant and admitted to the core in the policy's
    # order (admission.py); past max_active + max_backlog the rest wait in JetStream.
    max_backlog: int = 10_000
    # Requests of one tenant queued in that backlog at most: the next one taken in is answered
    # ``rate_limited`` (the gateway: 429), so one tenant cannot hold more than half the backlog and
    # push the others' requests back into JetStream (0: no limit). The counts are published to
    # ``{ns}:backlog`` for the gateway's per-tenant queued limit (intake.py).
    max_tenant_backlog: int = 5_000
    max_node_retries: int = 2  # a node that failed (retryably) runs again at most this often
    max_restarts: int = 2  # a request whose inputs were lost restarts as a new attempt at most this often
    request_ttl_s: int = 86400  # how long request state stays in Redis after it ends
    # How often the leader broadcasts the attempts it has in progress (``LiveAttempts``): executors
    # free what they hold of any other (a lost release). 0: never.
    reconcile_s: float = 10.0
    view_s: float = 1.0  # how often the per-tenant operator view is refreshed in Redis
    # A dispatched node may run max(node_time_limit_s, node_time_factor × its estimate); past that it
    # is requeued elsewhere and its executor gets no work until it stops reporting it (0: no limit).
    node_time_limit_s: float = 600.0
    node_time_factor: float = 10.0
    # Transient failures (registry or Redis unreachable) are retried inside the scheduler with
    # exponential back-off from retry_initial_s up to retry_max_s, the intake message kept alive.
    retry_initial_s: float = 0.2
    retry_max_s: float = 5.0
    registry_timeout_s: float = 5.0  # one registry lookup's wait for an answer
    # An intake message delivered more often than this (each delivery past the first is a scheduler
    # that crashed or lost it) is answered with a failed result ("internal") instead of taken in.
    max_deliveries: int = 10
    result_retry_s: float = 3600.0  # how long the final write of a result to Redis is retried
    # The leader lease (lease.py, docs/scheduling.md "Fail-over"), kept by a thread of its own:
    # renewed every lease_ttl_s / 3; a leader whose lease is gone, or that could not reach Redis for
    # lease_ttl_s, steps down and starts again as a standby, which polls for it every lease_poll_s.
    lease_ttl_s: float = 3.0
    lease_poll_s: float = 0.5
    # A stall of the event loop longer than this is logged with the stack of the code that blocks
    # it (libs/common/watchdog.py); every stall is observed in t2i_scheduler_loop_lag_seconds.
    loop_report_s: float = 0.5
    # A file to record the core's inputs to, one section per leadership, for replaying them into a
    # fresh core without brokers (services/scheduler/replay.py; ``{pid}`` in it: this process's id).
    # "" (default): nothing recorded.
    record: str = ""
