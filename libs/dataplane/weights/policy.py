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

    @property
    def resident(self) -> int:
        return len(self.regions)


class CachePolicy:
    """Residency of models' layers in two regions, LRU across models, prefixes within them.

    ``device_budget`` bounds the bytes of layers in the ``device`` region; ``arena_budget`` bounds
    those placed in the arena (the share of the arena that cached weights may use; communication
    can reclaim all of it, :meth:`reclaim`)."""

    def __init__(self, device_budget: int, arena_budget: int = 0) -> None:
        if device_budget < 0 or arena_budget < 0:
            raise ValueError("budgets must be >= 0")
        self.budgets = {DEVICE: int(device_budget), ARENA: int(arena_budget)}
        self.used = {DEVICE: 0, ARENA: 0}
        self._models: OrderedDict[Hashable, _Model] = OrderedDict()  # least recently used first

    # -- models ----------------------------------------------------------------------------------
    def add(self, key: Hashable, sizes: Sequence[int], keep: int | None = None) -> None:
        """Know ``key``'s layer sizes (nothing resident yet); it becomes the most recently used."""
        if key in self._models:
            raise ValueError(f"{key} is already known")
        if any(s < 0 for s in sizes):
            raise ValueError("layer sizes must be >= 0")
        n = len(sizes)
        self._models[key] = _Model(tuple(int(s) for s in sizes), n if keep is None else _clamp(keep, n))

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
        """The prefix ``key`` keeps in the first eviction phase (its Lₑ′)."""
        model = self._models[key]
        model.keep = _clamp(keep, len(model.sizes))

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
            for key, m in self._models.items()
            if not m.pins and key != exclude
            for s, r in zip(m.sizes, m.regions, strict=False)
            if r == region
        )
        if evictable < need:
            raise NoRoom(region, nbytes, self.budgets[region], self.used[region] - evictable)
        return self._evict_until(region, nbytes, exclude)

    def _evict_until(self, region: str, nbytes: int, exclude: Hashable = None) -> list[Eviction]:
        out: list[Eviction] = []
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
        for key, _layer in self.victims():
            if self.used[region] <= self.budgets[region]:
                break
            out.append(self._evict_top(key, self._models[key]))
        return out

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


def _clamp(value: int, n: int) -> int:
    return max(0, min(int(value), n))
