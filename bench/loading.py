"""Checkpoint loading: our data plane against safetensors, torch.load, diffusers and the disk itself.

Builds once (cached under ``--workdir``) a random-weight ``FluxTransformer2DModel`` of at least
``--size-mb`` MiB in fp32 (built on meta, filled from a seeded generator, ``save_pretrained`` to one
safetensors file), a ``torch.save`` of the same state dict, and our converted checkpoint
(``ensure_converted``: ``part-*.bin`` + ``index.json``). Then, cold (every file involved is fsynced
and dropped from the page cache with ``posix_fadvise(DONTNEED)`` before each run, and ``mincore``
confirms it), one run per method per round, methods interleaved (the order rotates each round):

* ours: ``Loader().load(ckpt_dir, device)`` + ``wait()`` (no host tier);
* ours end to end: ``load_component`` (meta build + bind to the loaded tensors);
* safetensors: ``safetensors.torch.load_file``;
* torch.load: of the ``.pt`` (``weights_only=True``, ``mmap=False``);
* diffusers: ``FluxTransformer2DModel.from_pretrained``;
* raw O_DIRECT: exactly our partition bytes, same chunk size and thread count as ours, into one
  preallocated, prefaulted aligned buffer: the disk's ceiling (no allocation, no parsing).

On ``--device cpu`` every method's result has one byte per 4 KiB of every tensor read (a strided
sum), so lazily mmapped results pay for their page faults inside the timing; on ``cuda`` each run
ends with ``torch.cuda.synchronize()`` on device tensors. Warm: a host-tier hit (a ``HostTier``
with a fresh name; a first load fills it; a second ``Loader`` on the tier is timed), destroyed at
the end. Outside timing, ours is checked bitwise against safetensors.

Prints median / min / max seconds and GB/s (1e9 B/s of tensor bytes) per method, the warm figure,
and ends with ``ours vs raw O_DIRECT: R x`` (raw / ours; 1.0 = as fast as the disk) and
``ours vs safetensors: R x`` (safetensors / ours), both from cold medians. Writes
``bench/results/loading.json`` (``--json`` to change).

    .venv/bin/python bench/loading.py [--size-mb 1024] [--rounds 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

MIB = 1 << 20
PAGE = mmap.PAGESIZE
ALIGN = 4096  # O_DIRECT: offsets, lengths and the buffer address aligned to this
SEED = 1234


# -- the model -----------------------------------------------------------------------------------


def flux_config(size_mb: int) -> dict[str, Any]:
    """A FluxTransformer2DModel config of at least ``size_mb`` MiB in fp32 (counted on meta)."""
    from diffusers import FluxTransformer2DModel

    d = 1024 if size_mb >= 512 else 512 if size_mb >= 32 else 256
    target = size_mb * MIB
    layers = 1
    while True:
        cfg = dict(
            num_layers=layers,
            num_single_layers=2 * layers,
            attention_head_dim=128 if d >= 512 else 64,
            num_attention_heads=d // (128 if d >= 512 else 64),
            joint_attention_dim=d,
            pooled_projection_dim=d // 2,
            axes_dims_rope=(16, 56, 56) if d >= 512 else (8, 28, 28),
        )
        with torch.device("meta"):
            m = FluxTransformer2DModel(**cfg)
        nbytes = sum(p.numel() * 4 for p in m.parameters())
        if nbytes >= target:
            return cfg
        layers += max(1, math.floor((target - nbytes) / (nbytes / layers)))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build(workdir: Path, size_mb: int, log: Callable[[str], None]) -> tuple[Path, Path, Path]:
    """(model root, component dir, .pt file); built once per size, reused after."""
    from diffusers import FluxTransformer2DModel

    root = workdir / f"flux-{size_mb}mb"
    comp = root / "transformer"
    pt = root / "state_dict.pt"
    done = root / ".built"
    if done.exists():
        return root, comp, pt
    cfg = flux_config(size_mb)
    log(f"building a random-weight FluxTransformer2DModel {cfg} under {root} (once)")
    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.normal_(0.0, 0.02, generator=gen)
    comp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(comp, safe_serialization=True, max_shard_size="1000GB")
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, pt)
    del model
    gc.collect()
    for f in [*comp.rglob("*"), pt]:
        if f.is_file():
            fsync_path(f)
    done.write_text(json.dumps(cfg))
    return root, comp, pt


# -- page cache ----------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore over a read-only mapping; faults nothing in)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            npages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * npages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            pages = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, pages * PAGE)


def drop_cache(files: list[Path]) -> float:
    """fsync + POSIX_FADV_DONTNEED every file; returns the fraction still resident after."""
    total = resident = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    for f in files:
        total += f.stat().st_size
        resident += resident_bytes(f)
    return resident / max(1, total)


# -- the methods ---------------------------------------------------------------------------------


def touch(tensors: Any, device: str) -> None:
    """CPU: read one byte per 4 KiB of every tensor (faults in lazily mapped pages). CUDA: sync."""
    if device != "cpu":
        torch.cuda.synchronize()
        return
    acc = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        b = t.detach().reshape(-1).view(torch.uint8)
        acc += int(b[::4096].sum(dtype=torch.int64))
    del acc


def tensor_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


class RawODirect:
    """Reads files with O_DIRECT into one preallocated, prefaulted, page-aligned buffer."""

    def __init__(self, files: list[Path], chunk_bytes: int, threads: int) -> None:
        self.files = files
        self.sizes = [f.stat().st_size for f in files]
        self.spans = [(s + ALIGN - 1) // ALIGN * ALIGN for s in self.sizes]
        self.chunk = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
        self.threads = threads
        self.buf = mmap.mmap(-1, max(ALIGN, sum(self.spans)))
        view = memoryview(self.buf)
        for off in range(0, len(self.buf), PAGE):  # prefault: the ceiling excludes allocation
            view[off] = 0
        view.release()

    def __call__(self) -> int:
        view = memoryview(self.buf)
        fds = [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in self.files]
        tasks, base = [], 0
        for fd, size, span in zip(fds, self.sizes, self.spans, strict=True):
            for off in range(0, span, self.chunk):
                n = min(self.chunk, span - off)
                tasks.append((fd, size, off, view[base + off : base + off + n]))
            base += span

        def read(task: tuple[int, int, int, memoryview]) -> int:
            fd, size, off, mv = task
            got = 0
            want = min(len(mv), size - off)
            while got < want:
                n = os.preadv(fd, [mv[got:]], off + got)
                if n <= 0:
                    raise OSError(f"short O_DIRECT read at {off + got}")
                got += n
            return got

        try:
            with ThreadPoolExecutor(self.threads) as pool:
                total = sum(pool.map(read, tasks))
        finally:
            for fd in fds:
                os.close(fd)
            for _, _, _, mv in tasks:
                mv.release()
            view.release()
        if total != sum(self.sizes):
            raise OSError(f"O_DIRECT read {total} bytes of {sum(self.sizes)}")
        return total


def measure_warm(
    new_loader: Callable[..., Any], ckpt: Path, device: str, nbytes: int, runs: int
) -> dict[str, Any]:
    """A host-tier hit: a fresh tier, a first load fills it (kept open, as another executor of the
    box would), then ``runs`` loads, each by a new ``HostTier`` object and a new ``Loader``, are
    timed. The tier is destroyed at the end, whatever happens."""
    from libs.dataplane.hosttier import HostTier

    name = f"bench-loading-{uuid.uuid4().hex[:8]}"
    budget = int(nbytes * 1.25) + 64 * MIB
    access = "copy" if device == "cpu" else "read"  # as the executors map it
    warm: dict[str, Any] = {"tier": name, "budget_bytes": budget, "block_access": access, "runs_s": []}
    filler = fill = None
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    if free < budget:
        warm["error"] = f"/dev/shm has {free / MIB:.0f} MiB free, the tier needs {budget / MIB:.0f} MiB"
        return warm
    try:
        filler = HostTier(name, budget, block_access=access)
        with new_loader(host_tier=filler) as loader:
            t = time.perf_counter()
            fill = loader.load(ckpt, device=device)
            fill.wait()
            touch(fill.tensors.values(), device)
            warm["fill_s"] = time.perf_counter() - t
        warm["fill_source"], warm["fill_bytes_from_disk"] = fill.source, fill.bytes_from_disk
        for _ in range(runs):
            tier = HostTier(name, budget, block_access=access)
            with new_loader(host_tier=tier) as loader:
                t = time.perf_counter()
                hit = loader.load(ckpt, device=device)
                hit.wait()
                touch(hit.tensors.values(), device)
                warm["runs_s"].append(time.perf_counter() - t)
                warm["source"], warm["bytes_from_disk"] = hit.source, hit.bytes_from_disk
                hit.close()
            tier.close()
            gc.collect()
        warm["median_s"] = statistics.median(warm["runs_s"])
        warm["gb_s"] = nbytes / warm["median_s"] / 1e9
        if warm["source"] != "host" or warm["bytes_from_disk"]:
            warm["error"] = f"not a hit: source {warm['source']}, {warm['bytes_from_disk']} B from disk"
    except Exception as e:  # noqa: BLE001 - reported; the cold figures stand on their own
        warm["error"] = f"{type(e).__name__}: {e}"
    finally:
        if fill is not None:
            fill.close()
        if filler is not None:
            filler.close()
        HostTier.destroy(name)
        gc.collect()
    return warm


# -- the run -------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="model size in MiB (fp32), at least")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--workdir", default=str(REPO / "var" / "bench-loading"))
    ap.add_argument("--disk-threads", type=int, default=4)
    ap.add_argument("--chunk-mb", type=int, default=16)
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "loading.json"))
    args = ap.parse_args()

    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    from libs.dataplane.checkpoint import ensure_converted
    from libs.dataplane.loader import Loader
    from libs.models.common import load_component

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    chunk_bytes = args.chunk_mb * MIB
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    root, comp, pt = build(Path(args.workdir), args.size_mb, log)
    (st_file,) = sorted(comp.glob("*.safetensors"))
    t0 = time.perf_counter()
    ckpt = Path(ensure_converted(comp, FluxTransformer2DModel, chunk_bytes=chunk_bytes))
    log(f"converted checkpoint: {ckpt} (ensure_converted: {time.perf_counter() - t0:.2f} s)")
    parts = sorted(ckpt.glob("part-*.bin"))
    if not parts:
        raise SystemExit(f"no part-*.bin under {ckpt}")
    files = sorted({p for p in [*comp.rglob("*"), pt] if p.is_file()} | set(parts))

    def new_loader(**kw: Any) -> Any:
        return Loader(disk_threads=args.disk_threads, chunk_bytes=chunk_bytes, **kw)

    # -- bitwise check, outside timing (also the warm-up of both code paths) --
    ref = load_file(str(st_file))
    nbytes = tensor_bytes(ref)
    with new_loader() as loader:
        lc = loader.load(ckpt, device="cpu")
        lc.wait()
    ours_sd = dict(lc.tensors)
    identical = set(ours_sd) == set(ref) and all(
        ours_sd[k].dtype == ref[k].dtype
        and ours_sd[k].shape == ref[k].shape
        and torch.equal(ours_sd[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8))
        for k in ref
    )
    with new_loader() as loader:
        model = load_component(
            FluxTransformer2DModel, str(root), subfolder="transformer", device="cpu", loader=loader
        )
    msd = model.state_dict()
    identical_e2e = set(msd) == set(ref) and all(
        torch.equal(msd[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8)) for k in ref
    )
    lc.close()
    del lc, ours_sd, ref, model, msd
    gc.collect()
    log(
        f"{len(parts)} partitions, {sum(p.stat().st_size for p in parts) / MIB:.0f} MiB; "
        f"tensor bytes {nbytes / MIB:.0f} MiB; bitwise identical to safetensors: ours {identical}, "
        f"load_component {identical_e2e}"
    )

    ours_disk_bytes: list[int] = []
    raw = RawODirect(parts, chunk_bytes, args.disk_threads)
    sync = (lambda: torch.cuda.synchronize()) if device != "cpu" else (lambda: None)

    def m_ours() -> float:
        with new_loader() as loader:
            t = time.perf_counter()
            lc = loader.load(ckpt, device=device)
            lc.wait()
            touch(lc.tensors.values(), device)
            dt = time.perf_counter() - t
            ours_disk_bytes.append(lc.bytes_from_disk)
            lc.close()
        return dt

    def m_e2e() -> float:
        with new_loader() as loader:
            t = time.perf_counter()
            model = load_component(
                FluxTransformer2DModel, str(root), subfolder="transformer", device=device, loader=loader
            )
            touch(model.state_dict().values(), device)
            dt = time.perf_counter() - t
            del model
        return dt

    def m_safetensors() -> float:
        t = time.perf_counter()
        sd = load_file(str(st_file), device=device)
        touch(sd.values(), device)
        return time.perf_counter() - t

    def m_torch_load() -> float:
        t = time.perf_counter()
        sd = torch.load(pt, map_location=device, weights_only=True, mmap=False)
        touch(sd.values(), device)
        return time.perf_counter() - t

    def m_diffusers() -> float:
        t = time.perf_counter()
        model = FluxTransformer2DModel.from_pretrained(
            str(root), subfolder="transformer", torch_dtype=torch.float32
        )
        if device != "cpu":
            model = model.to(device)
        touch(model.state_dict().values(), device)
        return time.perf_counter() - t

    def m_raw() -> float:
        t = time.perf_counter()
        raw()
        sync()
        return time.perf_counter() - t

    methods: dict[str, Callable[[], float]] = {
        "ours (Loader.load)": m_ours,
        "ours e2e (load_component)": m_e2e,
        "safetensors load_file": m_safetensors,
        "torch.load (.pt)": m_torch_load,
        "diffusers from_pretrained": m_diffusers,
        "raw O_DIRECT (disk ceiling)": m_raw,
    }
    byte_count = {name: nbytes for name in methods}
    byte_count["raw O_DIRECT (disk ceiling)"] = sum(raw.sizes)
    timings: dict[str, list[float]] = {name: [] for name in methods}
    residency: list[float] = []
    names = list(methods)
    for fn in methods.values():  # warm-up of every code path (imports, allocator), not timed
        fn()
        gc.collect()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            residency.append(drop_cache(files))
            timings[name].append(methods[name]())
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()
        log(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n.split(' (')[0]} {timings[n][-1]:.2f}s" for n in names)
        )

    # -- warm: a host-tier hit --
    warm = measure_warm(new_loader, ckpt, device, nbytes, max(1, args.rounds))

    # -- report --
    med = {n: statistics.median(v) for n, v in timings.items()}
    load_end = os.getloadavg()
    print()
    print(
        f"FluxTransformer2DModel fp32, {nbytes / MIB:.0f} MiB of tensors, device {device}, "
        f"{args.rounds} cold rounds, {args.disk_threads} disk threads x {args.chunk_mb} MiB chunks"
    )
    print(f"page cache after each drop: at most {100 * max(residency):.2f}% resident (mincore)")
    print(f"{'':30s}{'median s':>10s}{'min s':>8s}{'max s':>8s}{'GB/s':>8s}")
    for n, v in timings.items():
        print(f"{n:30s}{med[n]:10.3f}{min(v):8.3f}{max(v):8.3f}{byte_count[n] / med[n] / 1e9:8.2f}")
    if "error" in warm:
        print(f"warm host-tier hit: FAILED ({warm['error']})")
    else:
        print(
            f"warm host-tier hit (source {warm['source']}, {warm['bytes_from_disk']} B from disk): "
            f"{warm['median_s']:.3f} s, {warm['gb_s']:.2f} GB/s"
        )
    ratio_raw = med["raw O_DIRECT (disk ceiling)"] / med["ours (Loader.load)"]
    ratio_st = med["safetensors load_file"] / med["ours (Loader.load)"]
    print(f"ours vs raw O_DIRECT: {ratio_raw:.2f} x")
    print(f"ours vs safetensors: {ratio_st:.2f} x")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": device,
                "size_mb_requested": args.size_mb,
                "tensor_bytes": nbytes,
                "partition_bytes": sum(raw.sizes),
                "partitions": len(parts),
                "safetensors_bytes": st_file.stat().st_size,
                "config": json.loads((root / ".built").read_text()),
                "rounds": args.rounds,
                "disk_threads": args.disk_threads,
                "chunk_bytes": chunk_bytes,
                "identical_ours_vs_safetensors": identical,
                "identical_load_component_vs_safetensors": identical_e2e,
                "max_resident_fraction_after_drop": max(residency),
                "ours_bytes_from_disk": ours_disk_bytes,
                "cold_s": timings,
                "cold_median_s": med,
                "cold_median_gb_s": {n: byte_count[n] / med[n] / 1e9 for n in med},
                "warm_host_tier": warm,
                "ours_vs_raw_odirect": ratio_raw,
                "ours_vs_safetensors": ratio_st,
                "machine": {
                    "cpus": os.cpu_count(),
                    "loadavg_start": load_start,
                    "loadavg_end": load_end,
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name(0) if device != "cpu" else None,
                },
            },
            indent=1,
        )
    )
    return 0 if identical and identical_e2e and "error" not in warm else 1


if __name__ == "__main__":
    raise SystemExit(main())
