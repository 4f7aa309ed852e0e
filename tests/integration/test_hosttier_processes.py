"""The host tier shared by real processes: one fill box-wide, leases of live and dead processes, crashes.

Each child is a small Python process (``CHILD`` below) that opens the tier, asks for one key and
reports what it got; files in the test's temporary directory sequence it (no sleeps: every wait
is ``until_sync`` on a condition, with a deadline).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.dataplane.hosttier import PAGE, HostTier
from tests.support.waiting import until_sync

REPO = Path(__file__).resolve().parents[2]
BOUND = 20.0  # upper bound on any wait for another process

CHILD = r"""
import hashlib, json, os, sys
from pathlib import Path
from libs.dataplane.hosttier import HostTier
from tests.support.waiting import until_sync

args = json.loads(sys.argv[1])

def wait_for(path):
    if not until_sync(lambda: os.path.exists(path), args["bound"], 0.002):
        sys.exit(f"timed out waiting for {path}")

def fill(buf):
    with open(args["fills"], "a") as f:
        f.write(f"{os.getpid()}\n")
    if args.get("fill_started"):
        Path(args["fill_started"]).touch()
        wait_for(args["fill_gate"])
    seed = args["key"].encode()
    buf[:] = (seed * (len(buf) // len(seed) + 1))[: len(buf)]

tier = HostTier(args["name"], args["budget"])
block = tier.get_or_fill(args["key"], args["nbytes"], fill, tags=[args["key"]])
report = {"hit": block.hit, "cached": block.cached, "sha": hashlib.sha256(block.buf).hexdigest()}
print(json.dumps(report), flush=True)
if args.get("held"):
    Path(args["held"]).touch()
    wait_for(args["hold_gate"])
block.close()
tier.close()
"""

# Churn: threads asking for random keys of a tier too small for all of them, checking every block.
CHURN = r"""
import json, random, sys, threading
from libs.dataplane.hosttier import HostTier

args = json.loads(sys.argv[1])
tier = HostTier(args["name"], args["budget"])
bad = []

def work(seed):
    rng = random.Random(seed)
    for _ in range(args["rounds"]):
        key = rng.choice(args["keys"])
        nbytes = args["sizes"][key]
        seed_bytes = key.encode()
        want = (seed_bytes * (nbytes // len(seed_bytes) + 1))[:nbytes]
        def fill(buf):
            buf[:] = want
        with tier.get_or_fill(key, nbytes, fill) as block:
            if bytes(block.buf) != want:
                bad.append(key)

threads = [threading.Thread(target=work, args=(args["seed"] * 10 + i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
tier.close()
print(json.dumps({"bad": bad}))
"""


def pattern(key: str, nbytes: int) -> bytes:
    seed = key.encode()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def name() -> Iterator[str]:
    tier_name = f"test{uuid.uuid4().hex[:10]}"
    yield tier_name
    HostTier.destroy(tier_name)
    assert not list(Path("/dev/shm").glob(f"t2i-hosttier-{tier_name}.*"))


class Children:
    """Starts child processes on this test's tier and makes sure none outlives the test."""

    def __init__(self, name: str, tmp: Path) -> None:
        self.name, self.tmp, self.fills = name, tmp, tmp / "fills"
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, key: str, nbytes: int, budget: int, **files: str) -> subprocess.Popen[str]:
        args = {"name": self.name, "budget": budget, "key": key, "nbytes": nbytes, "bound": BOUND}
        args.update(fills=str(self.fills), **{k: str(self.tmp / v) for k, v in files.items()})
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def report(self, proc: subprocess.Popen[str]) -> dict[str, object]:
        out, _ = proc.communicate(timeout=BOUND)
        assert proc.returncode == 0, out
        return json.loads(out)

    def fill_count(self) -> int:
        return len(self.fills.read_text().split()) if self.fills.exists() else 0

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=BOUND)


@pytest.fixture
def children(name: str, tmp_path: Path) -> Iterator[Children]:
    made = Children(name, tmp_path)
    yield made
    made.kill_all()


def test_two_processes_asking_for_one_key_at_once_fill_it_once_and_see_the_same_bytes(
    name, children, tmp_path
):
    nbytes, budget = 3 * PAGE + 5, 16 * PAGE
    gated = {"fill_started": "started", "fill_gate": "gate"}
    procs = [children.start("ckpt", nbytes, budget, **gated) for _ in range(2)]
    with HostTier(name, budget) as tier:
        # The first to take the lock fills (and blocks in its fill); the other must wait for it.
        assert until_sync(
            lambda: (tmp_path / "started").exists() and tier.stats()["waits"] >= 1, BOUND, 0.002
        ), "no fill and waiter"
        assert not tier.contains("ckpt") and tier.tags() == set()
        (tmp_path / "gate").touch()
        reports = [children.report(p) for p in procs]
        assert children.fill_count() == 1
        assert sorted(r["hit"] for r in reports) == [False, True] and all(r["cached"] for r in reports)
        assert {r["sha"] for r in reports} == {sha(pattern("ckpt", nbytes))}
        stats = tier.stats()
        assert (stats["fills"], stats["misses"], stats["hits"], stats["waits"]) == (1, 1, 1, 1)
        assert (stats["bytes_filled"], stats["bytes_served"]) == (nbytes, nbytes)
        with tier.get_or_fill("ckpt", nbytes, lambda buf: pytest.fail("filled again")) as block:
            assert block.hit and sha(block.buf) == sha(pattern("ckpt", nbytes))
        assert tier.tags() == {"ckpt"} and children.fill_count() == 1


def test_an_entry_a_live_process_holds_is_kept_while_one_a_dead_process_held_is_evicted(
    name, children, tmp_path
):
    budget = 2 * PAGE
    live = children.start("live", PAGE, budget, held="live-held", hold_gate="live-gate")
    assert until_sync((tmp_path / "live-held").exists, BOUND, 0.002), "the live holder never held"
    dead = children.start("dead", PAGE, budget, held="dead-held", hold_gate="never")
    assert until_sync((tmp_path / "dead-held").exists, BOUND, 0.002), "the doomed holder never held"
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=BOUND)
    with HostTier(name, budget) as tier:
        # LRU alone would evict "live" (older); its holder is alive, so "dead" goes instead.
        with tier.get_or_fill(
            "new", PAGE, lambda buf: buf.__setitem__(slice(None), pattern("new", PAGE))
        ) as new:
            assert new.cached and not new.hit
            assert tier.contains("live") and not tier.contains("dead") and tier.contains("new")
            assert tier.stats()["evictions"] == 1
            # Everything left is leased by a live process: no room, so an uncached block.
            with tier.get_or_fill("more", PAGE, lambda buf: None) as more:
                assert not more.cached
        files = sorted(p.name for p in Path("/dev/shm").glob(f"t2i-hosttier-{name}.*"))
        assert sum(".seg-" in f for f in files) == 2  # the dead holder's segment was unlinked
        assert sum(".owner-" in f for f in files) == 2  # the live child and this test; the dead one's is gone
        (tmp_path / "live-gate").touch()
        assert children.report(live)["sha"] == sha(pattern("live", PAGE))


def test_a_process_killed_mid_fill_leaves_an_entry_the_next_caller_reclaims_and_refills(
    name, children, tmp_path
):
    nbytes, budget = 2 * PAGE, 4 * PAGE
    filler = children.start("ckpt", nbytes, budget, fill_started="started", fill_gate="never")
    assert until_sync((tmp_path / "started").exists, BOUND, 0.002), "the fill never started"
    filler.send_signal(signal.SIGKILL)
    filler.wait(timeout=BOUND)
    with HostTier(name, budget) as tier:
        calls: list[int] = []

        def fill(buf: memoryview) -> None:
            calls.append(len(buf))
            buf[:] = pattern("ckpt", len(buf))

        with tier.get_or_fill("ckpt", nbytes, fill) as block:
            assert not block.hit and block.cached and calls == [nbytes]
            assert bytes(block.buf) == pattern("ckpt", nbytes)
        stats = tier.stats()
        assert (stats["reclaimed"], stats["fills"], stats["entries"], stats["used_bytes"]) == (
            1,
            1,
            1,
            nbytes,
        )
        assert len(list(Path("/dev/shm").glob(f"t2i-hosttier-{name}.seg-*"))) == 1
    assert children.fill_count() == 1  # the killed child's attempt


def test_processes_and_threads_churning_through_a_small_tier_always_see_the_right_bytes(name, tmp_path):
    keys = [f"k{i}" for i in range(6)]
    sizes = {k: (i + 1) * PAGE - 7 for i, k in enumerate(keys)}
    budget = 8 * PAGE  # room for two or three of them
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = []
    for seed in range(3):
        args = {"name": name, "budget": budget, "keys": keys, "sizes": sizes, "rounds": 40, "seed": seed}
        cmd = [sys.executable, "-c", CHURN, json.dumps(args)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=BOUND)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0, 0] and all(json.loads(o)["bad"] == [] for o in outs)
    with HostTier(name, budget) as tier:
        stats = tier.stats()
        assert stats["hits"] + stats["misses"] == 3 * 2 * 40
        assert stats["used_bytes"] <= budget and stats["leased_entries"] == 0
        assert stats["fills"] + stats["uncached"] == stats["misses"]
        segments = list(Path("/dev/shm").glob(f"t2i-hosttier-{name}.seg-*"))
        assert len(segments) == stats["entries"] == stats["ready_entries"]
