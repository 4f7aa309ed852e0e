"""How long a namespace goes without a leading scheduler when its leader dies, against the bound
the lease sets (``docs/scheduling.md``, "Fail-over").

Two real scheduler processes (``python -m services.scheduler``) share a namespace on the local NATS
and Redis. For each rep the leader is SIGKILLed (a crash: its lease is left to expire), and the
time until the standby holds the lease is measured from the kill. The lease allows at most its TTL
(counted from the leader's last renewal, which came up to ``ttl/3`` before the kill) plus one poll
of the standby, so the *bound* is ``ttl + poll``: the ratio says how much of it was used. The dead
leader is then started again, as a standby: the next rep kills the new leader.

Writes ``bench/results/failover.json``. Usage: ``python bench/failover.py [--reps 5] [--ttl-s 3]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from libs.launcher import brokers  # noqa: E402
from libs.launcher.stack import Stack  # noqa: E402
from libs.protocol.keys import Keys  # noqa: E402


def holder_pid(r: redis.Redis, keys: Keys) -> int | None:
    v = r.get(keys.scheduler_lease)
    return None if v is None else int(v.decode().rsplit("-", 2)[1])


def wait_for(cond, within_s: float, step: float = 0.005) -> float:
    """Seconds until ``cond()`` held (raises past ``within_s``)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > within_s:
            raise RuntimeError(f"not within {within_s} s")
        time.sleep(step)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ttl-s", type=float, default=3.0)
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    nats_url, redis_url = "nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0"
    started = brokers.ensure_brokers(nats_url, redis_url, REPO / "var" / "bench", log=lambda *_: None)
    ns = "fo" + uuid.uuid4().hex[:8]
    keys = Keys(ns)
    r = redis.Redis.from_url(redis_url)
    stack = Stack(namespace=ns, log_dir=REPO / "var" / "bench" / "failover", model_root=REPO, executors=0,
                  nats_url=nats_url, redis_url=redis_url)  # fmt: skip
    env = {"T2I_SCHEDULER_LEASE_TTL_S": str(args.ttl_s), "T2I_SCHEDULER_LEASE_POLL_S": str(args.poll_s)}
    gaps: list[float] = []
    try:
        procs = {name: stack.spawn(name, "services.scheduler", **env) for name in ("a", "b")}
        for _ in range(args.reps):
            wait_for(lambda: holder_pid(r, keys) in {p.pid for p in procs.values()}, 60)
            leader = next(n for n, p in procs.items() if p.pid == holder_pid(r, keys))
            standby = next(n for n in procs if n != leader)
            wait_for(lambda s=standby: "polling for it" in stack.read_log(s), 60)
            time.sleep(args.ttl_s / 3 * 1.5)  # the kill falls anywhere in the renewal period
            procs[leader].send_signal(signal.SIGKILL)
            procs[leader].wait(10)
            pid = procs[standby].pid
            gap = wait_for(lambda pid=pid: holder_pid(r, keys) == pid, 60)
            gaps.append(gap)
            print(f"  takeover after {gap:.2f} s", file=sys.stderr)
            (stack.log_dir / f"{leader}.log").unlink()  # its next "polling for it" is the new one's
            procs[leader] = stack.spawn(leader, "services.scheduler", **env)  # a standby again
    finally:
        stack.stop()
        for k in r.scan_iter(match=keys.pattern()):
            r.delete(k)
        r.close()
        brokers.stop(started)
    bound = args.ttl_s + args.poll_s
    doc = {
        "ttl_s": args.ttl_s,
        "poll_s": args.poll_s,
        "bound_s": bound,
        "takeover_s": gaps,
        "median_s": statistics.median(gaps),
        "max_s": max(gaps),
        "max_over_bound": max(gaps) / bound,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failover.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"takeover after a leader's SIGKILL, {len(gaps)} reps, lease TTL {args.ttl_s:g} s, poll {args.poll_s:g} s"
    )
    print(f"median {doc['median_s']:.2f} s, max {doc['max_s']:.2f} s; bound (TTL + poll) {bound:.2f} s")
    print(f"max / bound {doc['max_over_bound']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
