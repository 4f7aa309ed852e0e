"""Data-plane pull bandwidth between two processes, against a memcpy baseline from the same run.

A producer process puts a tensor into its arena; this process (the consumer) pulls it with
``TensorStore.open`` (allocate in its own arena + transport read) ``--reps`` times. Baseline: one
``memcpy`` of the same size between two preallocated, faulted-in buffers in this process (a
memoryview assignment: glibc's memcpy on one thread, the least a pull must do). Each rep times a
memcpy and then a pull, so drift in the machine's load hits both alike; the ratio is the median of
the per-rep ratios. Also recorded, ``open_over_memcpy_best``: the fastest memcpy over the fastest
pull of the run (what each costs when nothing else on the box got in its way; on a shared box the
median ratio of a large size can swing past 1 when other jobs slow a run's memcpys). Also
printed: ``torch`` ``copy_`` between two tensors (the baseline before 2026-11-30: it runs on all
intra-op threads and, on this shared 2-core box, swung from 0.5 to 6 GB/s).
Also printed: ``copies per pull: same executor N, same box N, across boxes N``, the copies of the
bytes a consumer's side makes to get its tensor (``Lease.copies``): a view of our own arena, a
shared-memory pull, a TCP pull. Writes ``bench/results/dataplane.json``.

    .venv/bin/python bench/dataplane.py [--transports shm,tcp] [--sizes-mib 1,4,16,64,256] [--reps 31]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from libs.dataplane.store import TensorStore
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport
from libs.protocol.tensor_meta import decode_meta, encode_meta

MIB = 1 << 20


def _transport(kind: str, namespace: str, executor: str, capacity: int) -> Transport:
    if kind == "shm":
        return ShmTransport(namespace, executor, capacity)
    return TcpTransport("127.0.0.1", 0, capacity=capacity)


def _producer(conn: Connection, kind: str, namespace: str, capacity: int) -> None:
    with _transport(kind, namespace, "bench-producer", capacity) as transport:
        store = TensorStore("bench-producer", transport)
        conn.send("ready")
        while (msg := conn.recv()) is not None:
            op, nbytes = msg
            if op == "put":
                tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
                conn.send(encode_meta(store.put(f"bench/{nbytes}", tensor, consumers=1, group="bench")))
            else:
                conn.send(store.release(f"bench/{nbytes}"))


def memcpy_pair(nbytes: int) -> tuple[memoryview, memoryview]:
    """Two page-aligned, faulted-in buffers of ``nbytes``: (destination, source)."""
    src, dst = memoryview(mmap.mmap(-1, nbytes)), memoryview(mmap.mmap(-1, nbytes))
    src[:] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    dst[:] = src
    return dst, src


def torch_copy_gbps(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def bench_transport(kind: str, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Per size: open, read-only and memcpy GB/s (medians) and the median per-rep open/memcpy."""
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    capacity = 1 << (max(sizes) - 1).bit_length()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, kind, namespace, capacity), daemon=True)
    proc.start()
    results: dict[int, dict[str, float]] = {}
    try:
        if not conn.poll(120):
            raise TimeoutError("producer did not start")
        conn.recv()
        with _transport(kind, namespace, "bench-consumer", capacity) as transport:
            store = TensorStore("bench-consumer", transport)
            for nbytes in sizes:
                conn.send(("put", nbytes))
                meta = decode_meta(conn.recv())
                store.open(meta).close()  # warm-up: map the peer, fault our block in
                dst, src = memcpy_pair(nbytes)
                opens, reads, copies = [], [], []
                for _ in range(reps):
                    start = time.perf_counter()
                    dst[:] = src
                    copies.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    with store.open(meta) as lease:
                        opens.append(time.perf_counter() - start)
                        reads.append(lease.transfer_s)
                dst.release()
                src.release()
                with store.open(meta) as lease:
                    pull_copies = lease.copies
                results[nbytes] = {
                    "copies_per_pull": pull_copies,
                    "open_gbps": nbytes / statistics.median(opens) / 1e9,
                    "read_gbps": nbytes / statistics.median(reads) / 1e9,
                    "memcpy_gbps": nbytes / statistics.median(copies) / 1e9,
                    "open_over_memcpy": statistics.median(c / o for c, o in zip(copies, opens, strict=True)),
                    "open_over_memcpy_best": min(copies) / min(opens),
                }
                conn.send(("release", nbytes))
                conn.recv()
    finally:
        conn.send(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return results


def same_executor_copies(nbytes: int) -> int:
    """Copies a consumer on the producer's own executor gets its tensor with (a view: none)."""
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    with ShmTransport(namespace, "bench-self", 1 << (nbytes - 1).bit_length()) as transport:
        store = TensorStore("bench-self", transport)
        meta = store.put("bench/self", torch.zeros(nbytes, dtype=torch.uint8), consumers=1, group="bench")
        with store.open(meta) as lease:
            copies = lease.copies
        store.release("bench/self")
    return copies


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--sizes-mib", default="1,4,16,64,256")
    # 31, not 15: on the shared 2-core box the median of 15 per-rep ratios moved by ±0.05-0.08
    # from run to run at 4-64 MiB.
    parser.add_argument("--reps", type=int, default=31)
    args = parser.parse_args()
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.reps} interleaved reps"
    )
    torch_gbps = {n: torch_copy_gbps(n, args.reps) for n in sizes}
    print(
        f"{'transport':>9} {'size':>8} {'open GB/s':>10} {'read GB/s':>10} {'memcpy GB/s':>12} "
        f"{'open/memcpy':>12} {'best':>6} {'torch copy_':>12}"
    )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in args.transports.split(","):
        out[kind] = {}
        for nbytes, r in bench_transport(kind, sizes, args.reps).items():
            r["torch_copy_gbps"] = torch_gbps[nbytes]
            out[kind][f"{nbytes // MIB}MiB"] = r
            print(
                f"{kind:>9} {nbytes // MIB:>6}Mi {r['open_gbps']:>10.2f} {r['read_gbps']:>10.2f} "
                f"{r['memcpy_gbps']:>12.2f} {r['open_over_memcpy']:>12.2f} {r['open_over_memcpy_best']:>6.2f} "
                f"{torch_gbps[nbytes]:>12.2f}"
            )
    # Same box: shared memory; across boxes: TCP (the copies of the bytes this side makes per pull).
    per_pull = {
        "same executor": same_executor_copies(sizes[0]),
        "same box": next(iter(out["shm"].values()))["copies_per_pull"] if "shm" in out else None,
        "across boxes": next(iter(out["tcp"].values()))["copies_per_pull"] if "tcp" in out else None,
    }
    print("copies per pull: " + ", ".join(f"{k} {v if v is not None else '-'}" for k, v in per_pull.items()))
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "dataplane.json").write_text(
        json.dumps({"reps": args.reps, "copies_per_pull": per_pull, "transports": out}, indent=1)
    )


if __name__ == "__main__":
    main()
