"""The executor service: registers and heartbeats, runs dispatched nodes, serves the data plane.

One executor owns one accelerator (here: the CPU with a pinned thread count) and runs one node at
a time in a worker thread; the asyncio loop answers dispatches, releases and heartbeats meanwhile.
A dispatch is accepted with an ``Ack`` carrying the heartbeat sequence number, so the scheduler
can tell a lost completion from a slow one. After a node succeeds the executor uploads workflow
images to the object store, tells producers it has read their tensors (they free them at the last
reader, paper §5.2), and publishes ``NodeComplete`` with output metadata and measured times.

Subjects: the scheduler's messages (``Dispatch``, ``CallbackReady``, ``ReleaseRequest``,
``CancelNode``) come on ``{ns}.exec.{id}`` and ``{ns}.exec.all``; peers' ``ReleaseTensors`` on
``{ns}.exec.{id}.release`` only; events go out on this executor's own ``{ns}.sched.events.{id}``.

Fencing (``docs/scheduling.md``, "Fail-over"): the scheduler's messages carry its lease epoch; the
executor remembers the highest it has seen and refuses a ``Dispatch`` with a lower one (``Ack``
``ok=False``, ``STALE_EPOCH``: that scheduler steps down) and ignores such a ``CancelNode`` or
``ReleaseRequest``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.object_store import ObjectStore

from libs.common.logs import bind_request
from libs.common.metrics import ExecutorMetrics
from libs.common.retry import retry
from libs.common.service import run_all
from libs.protocol.ids import AttemptRef, ModelKey, NodeRef
from libs.protocol.messages import (
    STALE_EPOCH,
    Ack,
    CallbackReady,
    CancelNode,
    Dispatch,
    ExecutorGoodbye,
    ExecutorHeartbeat,
    ImageInput,
    ImageRef,
    LiveAttempts,
    NodeComplete,
    NodeFailed,
    ReleaseRequest,
    ReleaseTensors,
    encode,
    executor_decoder,
    peer_decoder,
)
from libs.protocol.subjects import Subjects
from services.executor.callbacks import CallbackBox
from services.executor.outcome import NodeError, NodeOutcome

log = logging.getLogger(__name__)

#: Chunk size of the PNGs we upload: a typical image in one chunk (the library's default, 128 KiB,
#: split a 256x256 PNG in two: a round trip more to write and another to read). The gateway reads
#: a chunk as base64 in a JSON reply, which must stay under NATS' 1 MiB payload limit.
IMAGE_CHUNK = 512 << 10


class Runner(Protocol):
    """Runs one node at a time: for real (a worker thread) or simulated (sleeping)."""

    callbacks: CallbackBox
    cancels_cleanly: bool  # whether cancelling ``run`` stops the node (else a time limit restarts us)
    host_report_blocks: bool  # whether ``host_report`` may block (a file lock): read off the loop

    async def run(self, d: Dispatch, blobs: dict[str, bytes] | None = None) -> NodeOutcome: ...

    def request_ended(self, request_id: str) -> None:
        """The scheduler released ``request_id`` (NoCache: nothing of it stays on the device)."""
        ...

    def follow(self, deployment: str) -> bool:
        """Cache weights at the granularity of the scheduler's ``deployment`` mode from now on;
        False (unchanged) when weights are already cached at another. ValueError: unknown mode."""
        ...

    def resident(self) -> list[ModelKey]: ...

    def cached(self) -> dict[ModelKey, tuple[int, int, int, int]]:
        """Per model with layers on the device: (resident layers, layers, resident bytes, bytes)."""
        ...

    def host_report(self) -> tuple[list[ModelKey], dict[str, int]]:
        """Models whose bytes the box's host tier holds, and the tier's counters (empty without one)."""
        ...

    def close(self) -> None: ...


class Store(Protocol):
    """The executor's side of the data plane: ``TensorStore``, or the simulator's metadata store."""

    transport: Any

    def stats(self) -> dict[str, Any]: ...

    def release(self, tensor_id: str, count: int = 1) -> bool: ...

    def discard(self, tensor_id: str) -> bool: ...

    def release_group(self, group: str) -> int: ...


class ExecutorService:
    def __init__(
        self,
        *,
        executor_id: str,
        kind: str,
        nc: Client,
        subjects: Subjects,
        store: Store,
        runner: Runner,
        images: ObjectStore,
        fns: list[str],
        heartbeat_s: float = 1.0,
        node_timeout_s: float = 0.0,
        attempt_ttl_s: float = 0.0,
        reconcile_grace_s: float = 30.0,
        metrics: ExecutorMetrics | None = None,
        gpu: str = "",
        follow_deployment: bool = True,
    ) -> None:
        # Shared by a process's executors (the ``executor`` label tells them apart); a registry of
        # its own otherwise, so executors built side by side in a test do not collide.
        self.metrics = metrics or ExecutorMetrics()
        self.gpu = gpu  # leased through the box's GPU lease ("": none), reported in heartbeats
        # One line per node: a real node takes seconds; simulated ones at scale would flood the log.
        self._node_log_level = logging.DEBUG if kind == "sim" else logging.INFO
        self.id = executor_id
        # A node running longer than this fails (retryable: the scheduler runs it elsewhere). A
        # runner that cannot stop it (a thread inside ``execute``) makes the executor exit for its
        # supervisor to restart it; 0: no limit.
        self.node_timeout_s = node_timeout_s
        self._wedged = asyncio.Event()
        # An attempt's tensors are freed by the scheduler's end-of-request release; if that message
        # is lost, they are freed once the attempt has had no node here for this long (longer than
        # any request may live). 0: never.
        self.attempt_ttl_s = attempt_ttl_s
        self.reconcile_grace_s = reconcile_grace_s
        self._attempt_seen: dict[AttemptRef, float] = {}
        self.kind = kind
        self.nc = nc
        self.subjects = subjects
        self.store = store
        self.runner = runner
        self.images = images
        self.fns = fns
        self.heartbeat_s = heartbeat_s
        self.seq = 0
        self.current: NodeRef | None = None  # the node being run
        # The node whose run a CancelNode may still stop (until its outputs are stored), its task,
        # and the node a CancelNode is stopping (its run answers NodeFailed instead of re-raising).
        self._cancellable: tuple[NodeRef, asyncio.Task] | None = None
        self._cancelling: NodeRef | None = None
        self.cancelled = 0  # nodes stopped by the scheduler's CancelNode
        self.started_at = time.time()
        self.nodes_run = 0
        # request id -> its attempts that ran here (their tensors and callback waits are ours to free)
        self._attempts: dict[str, set[AttemptRef]] = defaultdict(set)
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.epoch = 0  # the highest scheduler epoch seen (fencing)
        # Cache weights at the granularity of the deployment mode the scheduler's dispatches name
        # (False: the operator set the cache mode); the mode followed so far ("": none yet).
        self.follow_deployment = follow_deployment
        self._deployment = ""

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._subs.append(await self.nc.subscribe(self.subjects.executor(self.id), cb=self._on_msg))
        # Peers (consumers of our tensors) may publish here only: never on the subject above.
        self._subs.append(
            await self.nc.subscribe(self.subjects.executor_release(self.id), cb=self._on_release)
        )
        self._subs.append(await self.nc.subscribe(self.subjects.executors_all, cb=self._on_msg))
        await self.heartbeat()

    async def run(self) -> None:
        await run_all(self.heartbeat_loop(), self._until_wedged())

    async def _until_wedged(self) -> None:
        await self._wedged.wait()
        raise RuntimeError(
            f"a node overran the {self.node_timeout_s:g} s limit and cannot be stopped in its thread: "
            "exiting so the supervisor restarts this executor"
        )

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                self.sweep_attempts()
                await self.heartbeat()
            except Exception as e:  # noqa: BLE001 - a missed beat is retried next tick
                log.warning("heartbeat failed: %s", e)

    async def heartbeat(self) -> None:
        # The host tier's report takes a file lock: read it off the loop, before this beat's sequence
        # number and state are taken together (no await between them). A runner without a host tier
        # (simulated: ``host_report_blocks`` False) answers at once, without a thread hop.
        if self.runner.host_report_blocks:
            host_keys, host_stats = await asyncio.to_thread(self.runner.host_report)
        else:
            host_keys, host_stats = self.runner.host_report()
        self.metrics.sample_busy(self.id)
        self.seq += 1
        stats = self.store.stats()
        hb = ExecutorHeartbeat(
            executor=self.id,
            kind=self.kind,
            transport=self.store.transport.kind,
            address=self.store.transport.address,
            fns=self.fns,
            resident=[k.encode() for k in self.runner.resident()],
            host_resident=[k.encode() for k in host_keys],
            host_tier=host_stats,
            cached={k.encode(): list(v) for k, v in self.runner.cached().items() if v[0] > 0},
            running=[self.current.encode()] if self.current else [],
            arena_capacity=int(stats["capacity"]),
            arena_free=int(stats["free"]),
            started_at=self.started_at,
            seq=self.seq,
            host=socket.gethostname(),
            gpu=self.gpu,
        )
        await self.nc.publish(self.subjects.executor_events(self.id), encode(hb))

    async def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone already
                pass
        try:
            await self.nc.publish(self.subjects.executor_events(self.id), encode(ExecutorGoodbye(self.id)))
            await self.nc.flush(timeout=2)
        except Exception:  # noqa: BLE001
            pass
        for t in list(self._tasks):
            t.cancel()
        self.runner.close()

    # -- messages -------------------------------------------------------------------------------------
    async def _on_msg(self, msg: Msg) -> None:
        try:
            m = executor_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed message on %s: %s", msg.subject, e)
            if msg.reply:
                await msg.respond(encode(Ack(ok=False, error=f"malformed message: {e}")))
            return
        if isinstance(m, Dispatch | CancelNode | ReleaseRequest | LiveAttempts):
            if m.epoch < self.epoch:
                log.warning(
                    "refused a %s from a replaced scheduler (epoch %d < %d)",
                    type(m).__name__,
                    m.epoch,
                    self.epoch,
                )
                if isinstance(m, Dispatch):
                    await msg.respond(encode(Ack(ok=False, error=STALE_EPOCH, seq=self.seq)))
                return
            self.epoch = m.epoch
        match m:
            case Dispatch():
                await self._accept(m, msg)
            case CancelNode():
                self._cancel(m)
            case CallbackReady():
                self.runner.callbacks.deliver(m.ref.callback(m.input), m.meta)
            case ReleaseRequest(request_id=rid, attempt=attempt):
                attempts = list(self._attempts.get(rid, ())) if attempt < 0 else [AttemptRef(rid, attempt)]
                freed = self._release_attempts(attempts)
                if freed:
                    log.debug("released %d tensors of %s", freed, rid)
                self.runner.request_ended(rid)  # NoCache: nothing of the request stays (deployment modes)
            case LiveAttempts(attempts=raw):
                try:
                    live = {AttemptRef.decode(a) for a in raw}
                except ValueError as e:
                    log.warning("dropped a list of live attempts on %s: %s", msg.subject, e)
                    return
                self.reconcile(live)

    async def _on_release(self, msg: Msg) -> None:
        """A consumer has read tensors of ours: the only message peers may send us."""
        try:
            m = peer_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed message on %s: %s", msg.subject, e)
            return
        for tid in m.tensor_ids:
            self.store.release(tid)

    def _cancel(self, m: CancelNode) -> None:
        """Stop the node the scheduler cancels, if it is the one running here (else: ignored)."""
        node = m.ref
        running = self._cancellable
        if running is None or running[0] != node or running[1].done() or self._cancelling == node:
            log.debug("ignored a cancel of %s: not running it (running %s)", node, self.current)
            return
        clean = self.runner.cancels_cleanly
        if not clean and not m.restart_ok:
            log.info("not cancelling %s: its thread cannot be stopped, and no restart was asked", node)
            return
        log.warning("the scheduler cancels %s%s", node, "" if clean else " (this executor then restarts)")
        self._cancelling = node
        running[1].cancel()

    def _release_attempts(self, attempts: list[AttemptRef]) -> int:
        """Free what ``attempts`` hold here: their tensors and their callback waits."""
        for a in attempts:
            self.runner.callbacks.cancel(a)
        freed = sum(self.store.release_group(a.encode()) for a in attempts)
        for a in attempts:
            self._attempt_seen.pop(a, None)
            held = self._attempts.get(a.request_id)
            if held is not None:
                held.discard(a)
                if not held:
                    del self._attempts[a.request_id]
        return freed

    def reconcile(self, live: set[AttemptRef], now: float | None = None) -> int:
        """Free the attempts held here that the scheduler no longer has in progress (``live``) and
        that had no node here for ``reconcile_grace_s`` (so a dispatch racing the list is never
        hurt); returns the tensors freed."""
        return self._sweep(
            lambda a: a not in live,
            self.reconcile_grace_s,
            now,
            "the scheduler no longer has (their release was lost)",
        )

    def sweep_attempts(self, now: float | None = None) -> int:
        """Free the attempts that had no node here for ``attempt_ttl_s`` (their end-of-request
        release was lost); returns the tensors freed. Called with every heartbeat."""
        if self.attempt_ttl_s <= 0:
            return 0
        return self._sweep(
            lambda a: True,
            self.attempt_ttl_s,
            now,
            f"idle for over {self.attempt_ttl_s:g} s (their release never came)",
        )

    def _sweep(
        self, candidate: Callable[[AttemptRef], bool], idle_s: float, now: float | None, why: str
    ) -> int:
        """The one idle sweep: free the attempts ``candidate`` picks that had no node here for over
        ``idle_s`` (never the running one's)."""
        now = time.monotonic() if now is None else now
        running = self.current.attempt_ref if self.current is not None else None
        gone = [
            a
            for a, seen in self._attempt_seen.items()
            if a != running and now - seen > idle_s and candidate(a)
        ]
        if not gone:
            return 0
        freed = self._release_attempts(gone)
        log.warning(
            "freed %d tensors of %d attempts %s: %s", freed, len(gone), why, [a.encode() for a in gone[:5]]
        )
        return freed

    def _follow(self, deployment: str) -> None:
        """The scheduler's deployment mode, as its dispatch names it: cache weights at its
        granularity (an executor learns it from its first dispatch, before anything is cached)."""
        before, self._deployment = self._deployment, deployment
        try:
            followed = self.runner.follow(deployment)
        except ValueError as e:
            log.warning("the scheduler's deployment mode is not one this executor knows: %s", e)
            return
        if followed:
            log.info("caching weights for the scheduler's %r deployment mode", deployment)
        else:
            log.warning(
                "the scheduler's deployment mode is now %r (was %r) but weights are cached already; "
                "they stay cached as before: restart this executor, or set T2I_EXECUTOR_CACHE_MODE",
                deployment,
                before or "unknown",
            )

    async def _accept(self, d: Dispatch, msg: Msg) -> None:
        if self.current is not None or self._closed or self._wedged.is_set():
            await msg.respond(encode(Ack(ok=False, error=f"busy with {self.current}", seq=self.seq)))
            return
        if not msg.reply:  # nobody could be told it runs (the scheduler always asks): not taken
            log.warning("dropped dispatch %s: it has no reply subject", d.ref)
            return
        if self.follow_deployment and d.deployment and d.deployment != self._deployment:
            self._follow(d.deployment)
        self.current = d.ref
        try:
            await msg.respond(encode(Ack(ok=True, seq=self.seq)))
        except Exception as e:  # noqa: BLE001 - unanswered: the scheduler places it elsewhere
            log.warning("could not accept dispatch %s: %s: %s", d.ref, type(e).__name__, e)
            self.current = None
            return
        self.metrics.started(self.id, d.fn, d.model)
        task = asyncio.create_task(self._run(d))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, d: Dispatch) -> None:
        bind_request(d.request_id, executor=self.id)  # its lines (its threads' too) carry the ids
        node = d.ref
        self._attempts[d.request_id].add(node.attempt_ref)
        self._attempt_seen[node.attempt_ref] = time.monotonic()
        # The work a CancelNode may stop runs as its own task: cancelling it leaves this one to
        # answer (and stop() cancelling this one still cancels both).
        work = asyncio.ensure_future(self._execute(d))
        self._cancellable = (node, work)
        try:
            outcome, sinks = await work
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._cancelling != node or (me is not None and me.cancelling()):
                raise  # the executor is stopping
            self.cancelled += 1
            if not self.runner.cancels_cleanly:
                self._wedged.set()  # as for our own time limit: its thread still runs execute
            await self._finish(
                NodeFailed(self.id, d.request_id, d.attempt, d.node_id, "cancelled by the scheduler", True)
            )
            return
        except TimeoutError:
            log.error("node %s ran over the executor's %g s limit", node, self.node_timeout_s)
            if not self.runner.cancels_cleanly:
                self._wedged.set()  # its thread still runs execute: nothing else may run here
            await self._finish(
                NodeFailed(
                    self.id, d.request_id, d.attempt, d.node_id,
                    f"node ran over the executor's time limit ({self.node_timeout_s:g} s)", True,
                )
            )  # fmt: skip
            return
        except NodeError as e:
            log.warning("node %s failed: %s", node, e)
            await self._finish(
                NodeFailed(self.id, d.request_id, d.attempt, d.node_id, str(e), e.retryable, e.unreachable)
            )
            return
        except Exception as e:
            log.exception("node %s crashed", node)
            await self._finish(
                NodeFailed(self.id, d.request_id, d.attempt, d.node_id, f"executor error: {e}", True)
            )
            return
        finally:
            if self._cancellable is not None and self._cancellable[1] is work:  # not the next node's
                self._cancellable, self._cancelling = None, None
        await self._release_inputs(outcome)
        self.nodes_run += 1
        await self._finish(
            NodeComplete(
                executor=self.id,
                request_id=d.request_id,
                attempt=d.attempt,
                node_id=d.node_id,
                outputs=outcome.outputs,
                sinks=sinks,
                timing=outcome.timing,
                bytes_in=outcome.bytes_in,
            )
        )

    async def _execute(self, d: Dispatch) -> tuple[NodeOutcome, dict[str, ImageRef]]:
        """Fetch the node's pictures, run it (within the executor's limit), upload its sinks."""
        limit = self.node_timeout_s if self.node_timeout_s > 0 else None
        blobs = await self._fetch_images(d)
        async with asyncio.timeout(limit):  # as wait_for, without a task of its own per node
            outcome = await self.runner.run(d, blobs)
        return outcome, await self._upload(d, outcome)

    async def _fetch_images(self, d: Dispatch) -> dict[str, bytes]:
        """Pictures sent with the request (``image`` parameters) come from the images bucket."""
        from nats.js.errors import ObjectNotFoundError

        blobs: dict[str, bytes] = {}
        for inp in d.inputs.values():
            if isinstance(inp, ImageInput) and inp.name not in blobs:
                try:
                    name = inp.name
                    blobs[name] = (
                        await retry(lambda name=name: self.images.get(name), f"reading {name}")
                    ).data
                except ObjectNotFoundError:
                    pass  # the runner fails the node, naming the missing image
        return blobs

    async def _finish(self, event: NodeComplete | NodeFailed) -> None:
        self.current = None
        done = isinstance(event, NodeComplete)
        fn = self.metrics.ended(self.id, "succeeded" if done else "failed", event.timing if done else None)
        if done and log.isEnabledFor(self._node_log_level):
            t = event.timing
            log.log(
                self._node_log_level,
                "node %s (%s) of %s ran: load %.3fs%s, fetch %.3fs, exec %.3fs, store %.3fs",
                event.node_id, fn, event.request_id, t.load_s, f" from {t.load_tier}" if t.load_tier else "",
                t.fetch_s, t.exec_s, t.store_s,
            )  # fmt: skip
        await self.nc.publish(self.subjects.executor_events(self.id), encode(event))

    async def _upload(self, d: Dispatch, outcome: NodeOutcome) -> dict[str, ImageRef]:
        sinks: dict[str, ImageRef] = {}
        by_name = {p.name: p for p in d.outputs}
        for name, png in outcome.pngs.items():
            t0 = time.perf_counter()
            obj = by_name[name].sink
            await retry(
                lambda obj=obj, data=png.data: self.images.put(
                    obj,
                    data,
                    meta=ObjectMeta(name=obj, options=ObjectMetaOptions(max_chunk_size=IMAGE_CHUNK)),
                ),
                f"uploading {obj}",
            )
            sinks[name] = ImageRef(self.images._name, obj, len(png.data), png.width, png.height)  # noqa: SLF001
            log.debug("uploaded %s (%d bytes) in %.3fs", obj, len(png.data), time.perf_counter() - t0)
        return sinks

    async def _release_inputs(self, outcome: NodeOutcome) -> None:
        """One release per input edge, to the producer (ourselves: directly)."""
        remote: dict[str, list[str]] = defaultdict(list)
        for meta in outcome.reads:
            if meta.executor == self.id:
                self.store.release(meta.tensor_id)
            else:
                remote[meta.executor].append(meta.tensor_id)
        for producer, ids in remote.items():
            await self.nc.publish(self.subjects.executor_release(producer), encode(ReleaseTensors(ids)))


class ExecutorGroup:
    """The executors of one process as one service: one real executor, or many simulated ones.

    Started, run and stopped together; if one's heartbeat loop dies, the process stops. Once all
    have started it logs ``ready`` (the line ``libs.launcher`` waits for: "executor ready ...").
    """

    def __init__(self, members: list[ExecutorService], ready: str = "executor ready") -> None:
        self.members = members
        self.ready = ready

    async def start(self) -> None:
        for m in self.members:
            await m.start()
        log.info("%s", self.ready)

    async def run(self) -> None:
        await run_all(*(m.run() for m in self.members))

    async def stop(self) -> None:
        for m in self.members:
            await m.stop()
