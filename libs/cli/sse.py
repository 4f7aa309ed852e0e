"""Server-sent events, parsed from lines (the WHATWG event-stream rules the CLI needs).

The gateway's ``GET /v1/requests/{id}/events`` is read with a plain streaming HTTP client rather
than an SSE library: the format is a few lines of rules, and owning the parser lets the CLI keep
the last event id itself, so a dropped stream resumes with ``Last-Event-ID`` instead of starting
over.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    event: str  # "message" when the server named none
    data: str
    id: str | None  # the id the server gave this event (None: it gave none)


def parse(lines: Iterable[str]) -> Iterator[Event]:
    """The events in ``lines`` (each without its line ending), dispatched at each blank line.

    Comments (``: ping``) and fields other than ``event``, ``data`` and ``id`` are skipped; an event
    with no ``data`` is not dispatched, as in browsers. A last event not followed by a blank line
    is dropped: the stream ended in the middle of it.
    """
    event, data, ident, has_data = "", [], None, False
    for line in lines:
        if not line:
            if has_data:
                yield Event(event or "message", "\n".join(data), ident)
            event, data, ident, has_data = "", [], None, False
            continue
        if line.startswith(":"):
            continue
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
            has_data = True
        elif name == "id" and "\0" not in value:
            ident = value
