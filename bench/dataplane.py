"""Data-plane pull bandwidth between two processes, against a memcpy baseline from the same run.

A producer process puts a tensor into its arena; this process (the consumer) pulls it with
``TensorStore.open`` (allocate in its own arena + transport read) ``--reps`` times. Baseline:
``torch`` ``copy_`` between two preallocated host tensors of the same size in this process.

    .venv/bin/python bench/dataplane.py [--transports shm,tcp] [--sizes-mib 1,4,16,64,256] [--reps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from libs.dataplane.store import TensorStore  # noqa: E402
from libs.dataplane.transport import ShmTransport, TcpTransport, Transport  # noqa: E402
from libs.protocol.tensor_meta import decode_meta, encode_meta  # noqa: E402

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


def _median_s(fn: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    return nbytes / _median_s(lambda: dst.copy_(src), reps) / 1e9


def bench_transport(kind: str, sizes: list[int], reps: int) -> dict[int, tuple[float, float]]:
    """{nbytes: (open GB/s, read-only GB/s)} for pulls over ``kind``."""
    namespace = f"bench{uuid.uuid4().hex[:8]}"
    capacity = 1 << (max(sizes) - 1).bit_length()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, kind, namespace, capacity), daemon=True)
    proc.start()
    results: dict[int, tuple[float, float]] = {}
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
                transfer: list[float] = []

                def pull(meta=meta, transfer=transfer) -> None:
                    with store.open(meta) as lease:
                        transfer.append(lease.transfer_s)

                open_s = _median_s(pull, reps)
                results[nbytes] = (nbytes / open_s / 1e9, nbytes / statistics.median(transfer) / 1e9)
                conn.send(("release", nbytes))
                conn.recv()
    finally:
        conn.send(None)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--sizes-mib", default="1,4,16,64,256")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) * MIB for s in args.sizes_mib.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.reps} reps")
    baseline = {n: memcpy_gbps(n, args.reps) for n in sizes}
    print(
        f"{'transport':>9} {'size':>8} {'open GB/s':>10} {'read GB/s':>10} {'memcpy GB/s':>12} {'open/memcpy':>12}"
    )
    for kind in args.transports.split(","):
        for nbytes, (open_gbps, read_gbps) in bench_transport(kind, sizes, args.reps).items():
            print(
                f"{kind:>9} {nbytes // MIB:>6}Mi {open_gbps:>10.2f} {read_gbps:>10.2f} "
                f"{baseline[nbytes]:>12.2f} {open_gbps / baseline[nbytes]:>12.2f}"
            )


if __name__ == "__main__":
    main()
