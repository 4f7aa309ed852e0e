"""Recording the scheduler's inbox, and replaying it into a fresh state machine.

The state machine (``machine.py``) does no I/O and reads no clock: every input is an event from the
shell's one inbox, handled with the time passed in, and what it decides comes back as effects. So a
run of the scheduler is reproducible from the machine's state when recording began and the events
it handled since. :class:`Recorder` wraps the machine's ``handle`` inside the shell
(``T2I_SCHEDULER_RECORD``: a file path; each leadership appends its own section) and writes, per
event, the event, its time and a digest of the effects it returned. :func:`replay` unpickles the
starting machine, handles the same events at the same times, and reports every one whose effects
differ: an empty list is a deterministic machine. A failing chaos run can leave its recording
behind, and the scheduler's part of it can be stepped through in a debugger without brokers.

The file is a stream of pickles written and read by this code only (a recording is trusted input,
never read off the bus): one header (``("machine", <the pickled machine>)``), then
``("event", seq, event, now, digest)`` entries.
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


def digest(effects: Any) -> str:
    """What an event returned, comparably: the effects are dataclasses of wire structs whose
    ``repr`` is deterministic (no object ids)."""
    return repr(effects)


class Recorder:
    """Record every event ``machine`` handles to ``out`` (a path, appended to, or a binary file)."""

    def __init__(self, machine: Any, out: str | Path | BinaryIO) -> None:
        self.machine = machine
        self._file: BinaryIO = open(out, "ab") if isinstance(out, str | Path) else out
        self._lock = threading.Lock()
        self._seq = 0
        self._write(("machine", pickle.dumps(machine, protocol=pickle.HIGHEST_PROTOCOL)))
        handle = machine.handle

        def recorded(event: Any, now: float) -> Any:
            effects = handle(event, now)
            self._seq += 1
            self._write(("event", self._seq, event, now, digest(effects)))
            return effects

        machine.handle = recorded

    def _write(self, entry: tuple) -> None:
        with self._lock:
            pickle.dump(entry, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class Mismatch:
    seq: int
    event: str
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
        if entry[0] == "machine":
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
    """Feed one section's events into the machine it starts from; the machine afterwards and every
    event whose effects differ from the recorded ones."""
    kind, blob = section[0]
    assert kind == "machine"
    machine = pickle.loads(blob)
    mismatches: list[Mismatch] = []
    for _, seq, event, now, recorded in section[1:]:
        got = digest(machine.handle(event, now))
        if got != recorded:
            mismatches.append(Mismatch(seq, type(event).__name__, recorded, got))
    return machine, mismatches


def main(argv: list[str] | None = None) -> int:
    """``python -m services.scheduler.replay FILE...``: replay each recording; exit 1 on a mismatch."""
    ap = argparse.ArgumentParser(
        description="Replay scheduler recordings (T2I_SCHEDULER_RECORD) into fresh state machines."
    )
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    bad = 0
    for path in args.files:
        for i, section in enumerate(sections(path)):
            machine, mismatches = replay(section)
            print(
                f"{path} section {i}: {len(section) - 1} events, {len(mismatches)} differ; "
                f"{len(machine.core.runs)} requests in flight and {len(machine.backlog)} queued at the end"
            )
            for m in mismatches[:5]:
                print(
                    f"  event {m.seq} {m.event}:\n    recorded {m.recorded[:300]}\n    replayed {m.replayed[:300]}"
                )
            bad += len(mismatches)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
