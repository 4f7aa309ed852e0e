"""Recording the scheduler core's inputs, and replaying them into a fresh core.

The core (``core.py``) does no I/O and reads no clock: every input is a method call with the time
passed in, and what it decides comes back as effects. So a run of the scheduler is reproducible from
the core's state when recording began and the calls made on it since. :class:`Recorder` stands in for
the core inside the shell (``T2I_SCHEDULER_RECORD``: a file path; each leadership appends its own
section), forwarding every call and writing, per input, the call (method, arguments, the time in
them) and a digest of the effects it returned. :func:`replay` unpickles the starting core, makes the
same calls in the same order, and reports every call whose effects differ: an empty list is a
deterministic core. A failing chaos run can leave its recording behind, and the core's part of it can
be stepped through in a debugger without brokers.

The file is a stream of pickles written and read by this code only (a recording is trusted input,
never read off the bus): one header (``("core", <the pickled core>)``), then
``("call", seq, method, args, kwargs, digest)`` entries, and ``("seed", ...)`` for the vTime loaded
from Redis when a leader takes over (the one mutation of core state that is not a core method).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

#: The core's inputs: every method that changes its state or returns effects.
INPUTS = (
    "add_request",
    "on_heartbeat",
    "remove_executor",
    "dispatch_result",
    "expire",
    "schedule",
    "on_complete",
    "reject_completion",
    "on_failed",
    "cancel",
)


def digest(effects: Any) -> str:
    """What a call returned, comparably: the effects are dataclasses of wire structs whose ``repr``
    is deterministic (no object ids)."""
    return repr(effects)


class _Accounts:
    """The core's accounts, with ``load`` (the vTime a new leader reads from Redis) recorded."""

    def __init__(self, recorder: Recorder, accounts: Any) -> None:
        self._recorder = recorder
        self._accounts = accounts

    def load(self, *args: Any, **kwargs: Any) -> Any:
        self._recorder._write(("seed", args, kwargs))  # noqa: SLF001 - the recorder's own writer
        return self._accounts.load(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accounts, name)


class Recorder:
    """``core`` with its inputs recorded to ``out`` (a path, appended to, or a binary file)."""

    def __init__(self, core: Any, out: str | Path | BinaryIO) -> None:
        self.core = core
        self._file: BinaryIO = open(out, "ab") if isinstance(out, str | Path) else out
        self._lock = threading.Lock()
        self._seq = 0
        self.accounts = _Accounts(self, core.accounts)
        self._write(("core", pickle.dumps(core, protocol=pickle.HIGHEST_PROTOCOL)))

    def _write(self, entry: tuple) -> None:
        with self._lock:
            pickle.dump(entry, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._file.flush()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.core, name)
        if name not in INPUTS:
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            effects = attr(*args, **kwargs)
            self._seq += 1
            self._write(("call", self._seq, name, args, kwargs, digest(effects)))
            return effects

        return recorded

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class Mismatch:
    seq: int
    method: str
    recorded: str
    replayed: str


def sections(path: str | Path | bytes) -> Iterator[list[tuple]]:
    """The recording's sections (one per ``Recorder``, e.g. per leadership), each its entries."""
    data = Path(path).read_bytes() if not isinstance(path, bytes) else path
    buf = io.BytesIO(data)
    current: list[tuple] | None = None
    while buf.tell() < len(data):
        try:
            entry = pickle.load(buf)  # our own recording, never input from outside
        except (EOFError, pickle.UnpicklingError, ValueError):
            log.warning("recording %s ends in a truncated entry (its scheduler was killed mid-write)", path)
            break
        if entry[0] == "core":
            if current is not None:
                yield current
            current = [entry]
        elif current is not None:
            current.append(entry)
    if current is not None:
        yield current


def record_path(setting: str) -> str:
    """``T2I_SCHEDULER_RECORD`` with ``{pid}`` replaced by this process's id (several schedulers
    sharing one setting each write their own file)."""
    return setting.replace("{pid}", str(os.getpid()))


def replay(section: list[tuple]) -> tuple[Any, list[Mismatch]]:
    """Feed one section's calls into the core it starts from; the core afterwards and every call
    whose effects differ from the recorded ones."""
    kind, blob = section[0]
    assert kind == "core"
    core = pickle.loads(blob)
    mismatches: list[Mismatch] = []
    for entry in section[1:]:
        if entry[0] == "seed":
            _, args, kwargs = entry
            core.accounts.load(*args, **kwargs)
            continue
        _, seq, method, args, kwargs, recorded = entry
        got = digest(getattr(core, method)(*args, **kwargs))
        if got != recorded:
            mismatches.append(Mismatch(seq, method, recorded, got))
    return core, mismatches


def main(argv: list[str] | None = None) -> int:
    """``python -m services.scheduler.replay FILE...``: replay each recording; exit 1 on a mismatch."""
    ap = argparse.ArgumentParser(
        description="Replay scheduler recordings (T2I_SCHEDULER_RECORD) into fresh cores."
    )
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    bad = 0
    for path in args.files:
        for i, section in enumerate(sections(path)):
            core, mismatches = replay(section)
            calls = sum(1 for e in section if e[0] == "call")
            print(
                f"{path} section {i}: {calls} calls, {len(mismatches)} differ; {len(core.runs)} requests in flight at the end"
            )
            for m in mismatches[:5]:
                print(
                    f"  call {m.seq} {m.method}:\n    recorded {m.recorded[:300]}\n    replayed {m.replayed[:300]}"
                )
            bad += len(mismatches)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
