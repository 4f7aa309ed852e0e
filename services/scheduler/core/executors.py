"""What the scheduler core knows of one executor: its last report, what it runs, how busy it is.

A heartbeat is the executor's whole report (registration and liveness in one);
:meth:`ExecutorState.apply_report` takes it in, decoding the identifiers it carries and dropping (and logging once per
change) those that do not parse: a bad report off the bus must not stop the service. ``cached``
is how much of each model is on the device, as the fraction of its bytes (layer-granular caching,
paper §5.1: a prefix of a model's layers may be resident; a fully loaded model counts 1.0). ``busy``
is a recent-dispatch count that halves every ``LOAD_HALF_LIFE_S``: best-fit placement prefers the
least busy executor.
"""

from __future__ import annotations

import copyreg
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from libs.protocol.ids import ModelKey, NodeRef
from libs.protocol.messages import ExecutorHeartbeat

log = logging.getLogger(__name__)

LOAD_HALF_LIFE_S = 10.0


def cached_fraction(value: object) -> float | None:
    """The fraction of a model's bytes on the device from a heartbeat's ``cached`` entry
    ``[resident_layers, total_layers, resident_bytes, total_bytes]``; None when it is malformed
    (not four integers, negative, more resident than total, no layers, or no bytes while only some
    layers are resident). A model without weights (a noise sampler: ``[1, 1, 0, 0]``) is whole."""
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    layers, total_layers, nbytes, total_bytes = value
    if total_layers == 0 or layers > total_layers or nbytes > total_bytes:
        return None
    if total_bytes == 0:
        return 1.0 if layers == total_layers else None
    return nbytes / total_bytes


# The scheduler's state is pickled to start a recording (replay.py), and its read-only views of the
# executors' caches with it: as the plain dicts they wrap.
def read_only(d: dict) -> Mapping:
    return MappingProxyType(d)


copyreg.pickle(MappingProxyType, lambda m: (read_only, (dict(m),)))


@dataclass
class ExecutorState:
    id: str
    kind: str
    fns: frozenset[str]
    last_seen: float
    resident: frozenset[ModelKey] = frozenset()
    host_resident: frozenset[ModelKey] = frozenset()  # models whose bytes are in its box's host tier
    gpu: str = ""  # the GPU it leased ("": none), as its heartbeats say
    arena_capacity: int = 0  # 0: the executor reported no arena (placement ignores arena_free)
    arena_free: int = 0
    running: NodeRef | None = None  # node we dispatched to it and have not seen finish
    acked_seq: int | None = None  # executor's heartbeat seq when it accepted ``running``
    foreign: tuple[NodeRef, ...] = ()  # nodes it reports running that this scheduler never dispatched
    suspect: bool = False  # a dispatch to it went unanswered: skip it until it heartbeats again
    # A node that ran past its time limit there and was requeued elsewhere: the executor gets no
    # work until a heartbeat no longer reports it running (or its late completion or failure comes).
    hung: NodeRef | None = None
    load: float = 0.0
    load_at: float = 0.0
    malformed: frozenset[str] = frozenset()  # entries of its last heartbeat that did not parse
    # Model -> fraction of its bytes on the device (resident models: 1.0; absent: nothing cached).
    # Replaced by each report, never mutated, so snapshots share it.
    cached: Mapping[ModelKey, float] = field(default_factory=lambda: MappingProxyType({}))
    # Bumped by every change a policy sees (a report, a dispatch): ``seen.executor_info`` reuses
    # the snapshot value it built while this is unchanged (the incremental snapshot).
    version: int = field(default=0, repr=False, compare=False)
    info_cache: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def idle(self) -> bool:
        return self.running is None and self.hung is None and not self.foreign and not self.suspect

    def busy(self, now: float) -> float:
        """The recent-dispatch count, decayed to ``now``."""
        return self.load * 0.5 ** ((now - self.load_at) / LOAD_HALF_LIFE_S)

    def note_dispatch(self, node: NodeRef, now: float) -> None:
        self.running, self.acked_seq = node, None
        self.load = self.busy(now) + 1.0
        self.load_at = now
        self.version += 1

    def apply_report(self, hb: ExecutorHeartbeat, now: float) -> list[NodeRef]:
        """Take in a heartbeat; return the nodes it reports running."""
        self.gpu = hb.gpu
        resident: list[ModelKey] = []
        host_resident: list[ModelKey] = []
        running: list[NodeRef] = []
        bad: list[str] = []
        for raws, out in ((hb.resident, resident), (hb.host_resident, host_resident)):
            for raw in raws:
                try:
                    out.append(ModelKey.decode(raw))
                except ValueError:
                    bad.append(raw)
        for raw in hb.running:
            try:
                running.append(NodeRef.decode(raw))
            except ValueError:
                bad.append(raw)
        cached: dict[ModelKey, float] = {}
        for raw, value in hb.cached.items():
            frac = cached_fraction(value)
            try:
                key = ModelKey.decode(raw)
            except ValueError:
                frac = None
            if frac is None:
                bad.append(f"cached {raw}={value!r}")
            elif frac > 0.0:
                cached[key] = frac
        cached.update(dict.fromkeys(resident, 1.0))
        malformed = frozenset(bad)
        if malformed != self.malformed:
            self.malformed = malformed
            if malformed:
                log.warning("executor %s reported malformed entries, ignored: %s", self.id, sorted(bad))
        self.last_seen = now
        self.fns = frozenset(hb.fns)
        self.resident = frozenset(resident)
        self.host_resident = frozenset(host_resident)
        self.cached = MappingProxyType(cached)
        self.arena_capacity = hb.arena_capacity
        self.arena_free = hb.arena_free
        self.suspect = False
        self.version += 1
        if self.hung is not None and self.hung not in running:
            log.info(
                "executor %s no longer runs %s, which overran its limit: it takes work again",
                self.id,
                self.hung,
            )
            self.hung = None
        return running
