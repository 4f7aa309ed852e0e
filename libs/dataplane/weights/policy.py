"""Which layers of which models stay on the device: the cache policy, shared by real and simulated
executors.

The paper (ServerlessT2I, arXiv 2607.26566, §5.3) treats every cached weight as elastic state. An
executor's device memory holds its models layer by layer, in two *regions*: ``device`` (the
framework's allocator, up to a budget) and ``arena`` (free space of the data-plane arena, which
communication may take back at any time). A model's resident layers are always a *prefix* of its
layers: loads go in layer order and evictions in reverse layer order, so whatever is left is the
part that lets loading overlap with computing (:mod:`libs.dataplane.weights.prefix`).

Eviction order, when a region needs ``n`` bytes:

1. models in least-recently-used order, skipping *pinned* ones (a model that is executing, or
   loading to execute, is never evicted); each gives up its top layers down to its ``keep`` (its
   Lₑ′: those layers cost nothing to reload, the reload hides behind the prefix's compute);
2. then the same models, LRU first, give up their prefixes, top layer first.

Only bytes in the region that needs them count, but the layer evicted is always the model's top
layer whatever its region, so residency stays a prefix.

That is the ``layer`` *granularity* (ServerlessT2I's). The paper's baselines (§8.1; the deployment
modes of docs/scheduling.md) cache coarser units with the same LRU order, and evict a unit whole:

* ``model`` (MCache): whole models, least recently used first; no prefix is ever left behind;
* ``workflow`` (WCache): whole workflows: every model added with the same ``group`` (its workflow)
  goes at once, the group least recently used (by its most recent model) first, and none while any
  model of the group is pinned. The executors key such models by ``(workflow, model)``, so each
  workflow holds its own copy of a shared model, as separate GPU functions would;
* ``none`` (NoCache): as ``model`` under pressure, and :meth:`CachePolicy.begin_request` /
  :meth:`CachePolicy.end_request` evict everything unpinned when a request ends, or when a node of
  another request starts, so every request loads all its models.

:class:`CachePolicy` is bookkeeping only: no clock, no I/O, no torch. The executor's runtime
(:mod:`services.executor.weights`) and the simulated executor apply its decisions, so both make the
same ones for the same sequence of requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

DEVICE = "device"
ARENA = "arena"
REGIONS = (DEVICE, ARENA)

LAYER = "layer"  # ServerlessT2I: layer prefixes, LRU across models
MODEL = "model"  # MCache: whole models, LRU
WORKFLOW = "workflow"  # WCache: whole workflows (models of one group), LRU
NONE = "none"  # NoCache: whole models, and nothing kept once a request ends
GRANULARITIES = (LAYER, MODEL, WORKFLOW, NONE)


class NoRoom(Exception):
    """The region cannot hold ``nbytes`` more even after evicting every unpinned layer."""

    def __init__(self, region: str, nbytes: int, budget: int, pinned: int) -> None:
        super().__init__(
            f"{nbytes} bytes do not fit in the {region} region ({budget} bytes, {pinned} held by "
            "models that are executing)"
        )
        self.region = region
        self.nbytes = nbytes


@dataclass(frozen=True)
class Eviction:
    key: Hashable
    layer: int
    region: str
    nbytes: int


@dataclass
class _Model:
    sizes: tuple[int, ...]
    keep: int
    regions: list[str] = field(default_factory=list)  # region of each resident layer (a prefix)
    pins: int = 0
    group: Hashable = None  # the workflow it belongs to (the ``workflow`` granularity's unit)

    @property
    def resident(self) -> int:
        return len(self.regions)


class CachePolicy:
    """Residency of models' layers in two regions, LRU across models, prefixes within them.

    ``device_budget`` bounds the bytes of layers in the ``device`` region; ``arena_budget`` bounds
    those placed in the arena (the share of the arena that cached weights may use; communication
    can reclaim all of it, :meth:`reclaim`). ``granularity`` is the unit evicted (module docstring):
    ``layer`` (default), ``model``, ``workflow`` or ``none``."""

    def __init__(self, device_budget: int, arena_budget: int = 0, granularity: str = LAYER) -> None:
        if device_budget < 0 or arena_budget < 0:
            raise ValueError("budgets must be >= 0")
        if granularity not in GRANULARITIES:
            raise ValueError(
                f"unknown cache granularity {granularity!r}; choose one of {list(GRANULARITIES)}"
            )
        self.granularity = granularity
        self.budgets = {DEVICE: int(device_budget), ARENA: int(arena_budget)}
        self.used = {DEVICE: 0, ARENA: 0}
        self._models: OrderedDict[Hashable, _Model] = OrderedDict()  # least recently used first
        self._request: Hashable = None  # the request whose nodes run here (``none`` granularity)

    def regranulate(self, granularity: str) -> bool:
        """Keep weights at ``granularity`` from now on, if nothing is known yet (an executor that
        follows its scheduler's deployment mode learns it from the first dispatch). False, and
        unchanged, when models are known at another one: their units would not match."""
        if granularity not in GRANULARITIES:
            raise ValueError(
                f"unknown cache granularity {granularity!r}; choose one of {list(GRANULARITIES)}"
            )
        if granularity == self.granularity:
            return True
        if self._models:
            return False
        self.granularity = granularity
        return True

    # -- models ----------------------------------------------------------------------------------
    def add(
        self, key: Hashable, sizes: Sequence[int], keep: int | None = None, group: Hashable = None
    ) -> None:
        """Know ``key``'s layer sizes (nothing resident yet); it becomes the most recently used.
        ``group`` is its workflow (evicted together under the ``workflow`` granularity)."""
        if key in self._models:
            raise ValueError(f"{key} is already known")
        if any(s < 0 for s in sizes):
            raise ValueError("layer sizes must be >= 0")
        n = len(sizes)
        keep = n if keep is None else _clamp(keep, n)
        if self.granularity != LAYER:
            keep = 0  # coarse units never keep a prefix behind
        self._models[key] = _Model(tuple(int(s) for s in sizes), keep, group=group)

    def remove(self, key: Hashable) -> list[Eviction]:
        """Forget ``key``; returns its resident layers (top first) for the caller to free."""
        model = self._models[key]
        if model.pins:
            raise ValueError(f"{key} is pinned")
        out = [self._evict_top(key, model) for _ in range(model.resident)]
        del self._models[key]
        return out

    def __contains__(self, key: object) -> bool:
        return key in self._models

    def keys(self) -> list[Hashable]:
        """Known models, least recently used first."""
        return list(self._models)

    def sizes(self, key: Hashable) -> tuple[int, ...]:
        return self._models[key].sizes

    def resident(self, key: Hashable) -> int:
        """How many first layers of ``key`` are on the device (0 for an unknown model)."""
        model = self._models.get(key)
        return model.resident if model else 0

    def resident_bytes(self, key: Hashable) -> int:
        model = self._models[key]
        return sum(model.sizes[: model.resident])

    def region(self, key: Hashable, layer: int) -> str | None:
        regions = self._models[key].regions
        return regions[layer] if layer < len(regions) else None

    def keep(self, key: Hashable) -> int:
        return self._models[key].keep

    def set_keep(self, key: Hashable, keep: int) -> None:
        """The prefix ``key`` keeps in the first eviction phase (its Lₑ′; layer granularity only)."""
        model = self._models[key]
        model.keep = _clamp(keep, len(model.sizes)) if self.granularity == LAYER else 0

    def touch(self, key: Hashable) -> None:
        self._models.move_to_end(key)

    def pin(self, key: Hashable) -> None:
        """``key`` is executing (or loading to execute): none of its layers may be evicted."""
        self._models[key].pins += 1
        self._models.move_to_end(key)

    def unpin(self, key: Hashable) -> None:
        model = self._models[key]
        if model.pins <= 0:
            raise ValueError(f"{key} is not pinned")
        model.pins -= 1

    def pinned(self, key: Hashable) -> bool:
        return self._models[key].pins > 0

    def snapshot(self) -> dict[Hashable, tuple[int, int, int, int]]:
        """Per model with any layer resident: (resident layers, layers, resident bytes, bytes)."""
        out = {}
        for key, m in self._models.items():
            if m.resident:
                out[key] = (m.resident, len(m.sizes), sum(m.sizes[: m.resident]), sum(m.sizes))
        return out

    # -- decisions -------------------------------------------------------------------------------
    def free(self, region: str) -> int:
        return self.budgets[region] - self.used[region]

    def choose_region(self, nbytes: int) -> str | None:
        """Where a new layer of ``nbytes`` goes without evicting anything: the device region if it
        has room, else the arena's share; None if neither has."""
        for region in REGIONS:
            if self.free(region) >= nbytes:
                return region
        return None

    def victims(self, exclude: Hashable = None) -> Iterator[tuple[Hashable, int]]:
        """(model, layer) in eviction order: phase 1 (down to each model's keep) then phase 2 (the
        prefixes), least recently used model first, top layer first, pinned models skipped. The
        order assumes each yielded layer is evicted before the next is asked for."""
        for phase in (1, 2):
            for key in list(self._models):
                model = self._models.get(key)
                if model is None or key == exclude or model.pins:
                    continue
                floor = model.keep if phase == 1 else 0
                while model.resident > floor:
                    yield key, model.resident - 1

    def make_room(self, region: str, nbytes: int, exclude: Hashable = None) -> list[Eviction]:
        """Evict (in :meth:`victims` order) until ``region`` has ``nbytes`` free; returns what was
        evicted, in order, for the caller to free. Raises :class:`NoRoom` (having evicted nothing)
        when even every unpinned layer would not make room."""
        need = nbytes - self.free(region)
        if need <= 0:
            return []
        evictable = sum(
            s
            for unit in self._units(exclude)
            for key in unit
            for s, r in zip(self._models[key].sizes, self._models[key].regions, strict=False)
            if r == region
        )
        if evictable < need:
            raise NoRoom(region, nbytes, self.budgets[region], self.used[region] - evictable)
        return self._evict_until(region, nbytes, exclude)

    def _evict_until(self, region: str, nbytes: int, exclude: Hashable = None) -> list[Eviction]:
        out: list[Eviction] = []
        if self.granularity != LAYER:
            for unit in list(self._units(exclude)):
                if self.free(region) >= nbytes:
                    break
                out += self._evict_unit(unit)
            return out
        for key, _layer in self.victims(exclude):
            if self.free(region) >= nbytes:
                break
            out.append(self._evict_top(key, self._models[key]))
        return out

    def acquire(
        self,
        key: Hashable,
        evict: Callable[[Eviction], None],
        try_arena: Callable[[int, int], bool] | None = None,
    ) -> list[tuple[int, str]]:
        """Pin ``key`` and give each of its missing layers a region, in layer order: the device
        region while it has room, else the arena's share (``try_arena(layer, nbytes)`` allocates
        there for real and may fail: communication holds the space), else the device region after
        evicting others (``evict`` is called with each eviction as it is decided, so the caller frees
        memory before placing). A model larger than everything evictable runs over the device
        budget; :meth:`over_budget` trims it back after it is unpinned. Returns the placements;
        the caller loads the layers in that order. The caller unpins when the model is done."""
        self.pin(key)
        model = self._models[key]
        placements: list[tuple[int, str]] = []
        for layer in range(model.resident, len(model.sizes)):
            nbytes = model.sizes[layer]
            region = self.choose_region(nbytes)
            if region == ARENA and (try_arena is None or not try_arena(layer, nbytes)):
                region = None
            if region is None:
                region = DEVICE
                try:
                    evictions = self.make_room(DEVICE, nbytes, exclude=key)
                except NoRoom:  # what can go goes; the model runs over the budget
                    evictions = self._evict_until(DEVICE, nbytes, exclude=key)
                for ev in evictions:
                    evict(ev)
            self.placed(key, layer, region)
            placements.append((layer, region))
        return placements

    def reclaim(self, region: str, nbytes: int) -> list[Eviction]:
        """Communication needs ``nbytes`` of ``region`` (the arena) now: evict unpinned layers in
        :meth:`victims` order until at least ``nbytes`` of that region were freed, or nothing is left
        to evict. Never waits, never raises; returns the evictions."""
        out: list[Eviction] = []
        freed = 0
        if self.granularity != LAYER:  # whole units that hold some of the region, LRU first
            for unit in list(self._units()):
                if freed >= nbytes:
                    break
                if any(region in self._models[k].regions for k in unit):
                    evicted = self._evict_unit(unit)
                    out += evicted
                    freed += sum(ev.nbytes for ev in evicted if ev.region == region)
            return out
        for phase in (1, 2):  # victims() order, but a model without layers in region stays whole
            for key, model in list(self._models.items()):
                if model.pins:
                    continue
                floor = model.keep if phase == 1 else 0
                while freed < nbytes and model.resident > floor and region in model.regions:
                    ev = self._evict_top(key, model)
                    out.append(ev)
                    if ev.region == region:
                        freed += ev.nbytes
        return out

    def shrink(self, key: Hashable, resident: int, *, force: bool = False) -> list[Eviction]:
        """Evict ``key``'s top layers until ``resident`` remain (a test or benchmark setting a
        prefix). A pinned model refuses unless ``force`` (its owner undoing layers that never
        landed)."""
        model = self._models[key]
        if model.pins and not force:
            raise ValueError(f"{key} is pinned")
        return [self._evict_top(key, model) for _ in range(max(0, model.resident - resident))]

    def over_budget(self, region: str = DEVICE) -> list[Eviction]:
        """Bring ``region`` back within its budget (after a model larger than the free space ran
        over it while pinned), evicting in the usual order."""
        out: list[Eviction] = []
        if self.granularity != LAYER:
            for unit in list(self._units()):
                if self.used[region] <= self.budgets[region]:
                    break
                out += self._evict_unit(unit)
            return out
        for key, _layer in self.victims():
            if self.used[region] <= self.budgets[region]:
                break
            out.append(self._evict_top(key, self._models[key]))
        return out

    # -- coarse units (the baselines' granularities) ----------------------------------------------
    def _units(self, exclude: Hashable = None) -> Iterator[list[Hashable]]:
        """Eviction units with something resident, least recently used first: a model under the
        ``layer`` and ``model``/``none`` granularities (pinned ones and ``exclude`` skipped), a
        workflow's models under ``workflow`` (a group with a pinned model, or ``exclude``'s own group,
        skipped whole)."""
        if self.granularity != WORKFLOW:
            for key, m in self._models.items():
                if m.resident and not m.pins and key != exclude:
                    yield [key]
            return
        members: dict[Hashable, list[Hashable]] = {}
        for key, m in self._models.items():  # a group's recency: its most recently used model
            keys = members.pop(m.group, [])
            keys.append(key)
            members[m.group] = keys  # re-inserted: the groups end up in LRU order
        own = self._models[exclude].group if exclude in self._models else object()
        for group, keys in members.items():
            if group == own or any(self._models[k].pins for k in keys):
                continue
            if any(self._models[k].resident for k in keys):
                yield keys

    def _evict_unit(self, keys: list[Hashable]) -> list[Eviction]:
        out: list[Eviction] = []
        for key in keys:
            model = self._models[key]
            out += [self._evict_top(key, model) for _ in range(model.resident)]
        return out

    def clear(self) -> list[Eviction]:
        """Evict every layer of every unpinned model (NoCache at the end of a request)."""
        out: list[Eviction] = []
        for key, model in self._models.items():
            if not model.pins:
                out += [self._evict_top(key, model) for _ in range(model.resident)]
        return out

    def begin_request(self, request: Hashable) -> list[Eviction]:
        """A node of ``request`` is about to run. Under the ``none`` granularity a request other than
        the last one first finds the device empty (its GPU function starts cold); otherwise nothing."""
        if self.granularity != NONE or request == self._request:
            return []
        self._request = request
        return self.clear()

    def end_request(self, request: Hashable) -> list[Eviction]:
        """``request`` ended. Under the ``none`` granularity, if its nodes were the last to run here,
        nothing of it stays on the device; otherwise nothing happens."""
        if self.granularity != NONE or request != self._request:
            return []
        self._request = None
        return self.clear()

    # -- recording -------------------------------------------------------------------------------
    def placed(self, key: Hashable, layer: int, region: str) -> None:
        """Layer ``layer`` of ``key`` is now resident in ``region``; it must be the next layer."""
        model = self._models[key]
        if layer != model.resident:
            raise ValueError(f"{key}: layer {layer} placed, next is {model.resident}")
        if region not in REGIONS:
            raise ValueError(f"unknown region {region!r}")
        model.regions.append(region)
        self.used[region] += model.sizes[layer]

    def _evict_top(self, key: Hashable, model: _Model) -> Eviction:
        layer = model.resident - 1
        region = model.regions.pop()
        self.used[region] -= model.sizes[layer]
        return Eviction(key, layer, region, model.sizes[layer])


# The deployment modes (T2I_SCHEDULER_DEPLOYMENT, docs/scheduling.md) and the granularity each one's
# executors cache weights at.
DEPLOYMENT_GRANULARITY = {"ours": LAYER, "mcache": MODEL, "wcache": WORKFLOW, "nocache": NONE}


def cache_granularity(cache_mode: str = "", deployment: str = "") -> str:
    """An executor's granularity: ``cache_mode`` when set, else its deployment mode's (``layer``
    when neither is set). Raises ValueError for an unknown one."""
    if cache_mode:
        if cache_mode not in GRANULARITIES:
            raise ValueError(f"unknown cache mode {cache_mode!r}; choose one of {list(GRANULARITIES)}")
        return cache_mode
    try:
        return DEPLOYMENT_GRANULARITY[deployment or "ours"]
    except KeyError:
        raise ValueError(
            f"unknown deployment mode {deployment!r}; choose one of {list(DEPLOYMENT_GRANULARITY)}"
        ) from None


def cache_key(granularity: str, workflow: str, model: Hashable) -> Hashable:
    """The key an executor caches ``model`` under: ``(workflow, model)`` under the ``workflow``
    granularity (each workflow holds its own copy, as a separate GPU function would), else the model."""
    return (workflow, model) if granularity == WORKFLOW else model


def model_of(key: Hashable) -> Hashable:
    """The model a :func:`cache_key` caches."""
    return key[1] if type(key) is tuple else key


def per_model(
    snapshot: dict[Hashable, tuple[int, int, int, int]],
) -> dict[Hashable, tuple[int, int, int, int]]:
    """A :meth:`CachePolicy.snapshot` per model (what executors report): under the ``workflow``
    granularity the most resident copy of each model."""
    out: dict[Hashable, tuple[int, int, int, int]] = {}
    for key, entry in snapshot.items():
        model = model_of(key)
        if model not in out or entry[2] > out[model][2]:
            out[model] = entry
    return out


def _clamp(value: int, n: int) -> int:
    return max(0, min(int(value), n))
