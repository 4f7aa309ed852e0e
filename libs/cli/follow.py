"""Following a generation call to its end: its event stream, shown as progress over denoising steps.

The stream (``GET /v1/requests/{id}/events``) sends one ``node`` event per finished node with the
image's ``step``/``steps`` and ``done``/``total`` nodes, then one ``done`` event carrying the call's
final status object. A stream that breaks off is resumed with ``Last-Event-ID`` (a few times, with
back-off), so a gateway restart or a proxy's idle cut does not lose the call. A gateway without
the route (older than the CLI) is not an error for ``generate``: the CLI says so once and polls
``GET /v1/requests/{id}`` instead, showing the coarser progress that object carries.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from libs.cli.client import ApiFailure, Gateway, Unreachable

ENDED = {"succeeded", "failed", "cancelled"}
RESUME_ATTEMPTS = 5
POLL_S = 0.5


@dataclass
class ImageProgress:
    step: int = 0
    steps: int = 0
    done: int = 0
    total: int = 0

    @property
    def units(self) -> tuple[int, int]:
        """(completed, total) in denoising steps, or in nodes for a workflow without a loop."""
        return (self.step, self.steps) if self.steps > 0 else (self.done, self.total)


@dataclass
class Progress:
    """What is known of a call of ``n`` images, folded into one bar's completed/total."""

    n: int
    images: dict[int, ImageProgress] = field(default_factory=dict)

    def update(self, image: int, event: dict[str, Any]) -> ImageProgress:
        p = self.images.setdefault(image, ImageProgress())
        for name in ("step", "steps", "done", "total"):
            v = event.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                setattr(p, name, max(getattr(p, name), v) if name in ("step", "done") else v)
        return p

    def bar(self) -> tuple[int, int]:
        """(completed, total) over all images; images not heard of yet count as the known average."""
        units = [p.units for p in self.images.values()]
        completed = sum(c for c, _ in units)
        total = sum(t for _, t in units)
        missing = max(0, self.n - len(units))
        if missing and units:
            total += missing * (total // len(units))
        return completed, max(total, completed)


class Reporter(Protocol):
    def node(self, image: int, event: dict[str, Any], progress: Progress) -> None: ...

    def note(self, text: str) -> None: ...


def follow(gw: Gateway, call_id: str, n: int, reporter: Reporter) -> dict[str, Any]:
    """The call's final status object, reporting progress on the way."""
    progress = Progress(n)
    last_id: str | None = None
    failures = 0
    while True:
        try:
            for ev in gw.events(call_id, last_id):
                if ev.id:
                    last_id = ev.id
                failures = 0
                data = _json(ev.data)
                if ev.event == "node" and data is not None:
                    image = data.get("image", 0)
                    image = image if isinstance(image, int) and 0 <= image < max(n, 1) else 0
                    progress.update(image, data)
                    reporter.node(image, data, progress)
                elif ev.event == "done" and data is not None:
                    return data
            raise Unreachable("the event stream ended before the call did")
        except ApiFailure as e:
            if not e.route_missing:
                raise
            reporter.note(f"{e}; polling the call's status instead")
            return poll(gw, call_id, progress, reporter)
        except Unreachable as e:
            failures += 1
            if failures > RESUME_ATTEMPTS:
                raise
            reporter.note(f"{e}; resuming (attempt {failures} of {RESUME_ATTEMPTS})")
            time.sleep(min(0.25 * 2**failures, 5.0))


def poll(gw: Gateway, call_id: str, progress: Progress, reporter: Reporter) -> dict[str, Any]:
    """Read the status object until the call has ended; its ``progress`` field (whole call) drives the bar."""
    last: tuple[int, ...] = ()
    while True:
        status = gw.get(f"/v1/requests/{call_id}")
        p = status.get("progress")
        if isinstance(p, dict):
            event = {"step": p.get("step"), "steps": p.get("steps"), "done": p.get("nodes_done")}
            event["total"] = p.get("nodes_total")
            progress.n = 1  # the object sums over the call's images
            now = progress.update(0, event)
            key = (now.step, now.steps, now.done, now.total)
            if key != last:
                last = key
                reporter.node(0, event, progress)
        if status.get("status") in ENDED:
            return status
        time.sleep(POLL_S)


def _json(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None
