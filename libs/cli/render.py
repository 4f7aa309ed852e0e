"""What the CLI shows: progress (a rich bar on a terminal, one line per step otherwise) and tables.

Progress goes to stderr and results (saved paths, GPU seconds, tables) to stdout, so
``t2i generate … > paths.txt`` keeps only what a script wants. Off a terminal (CI logs, pipes) a
redrawn bar would be noise, so each new step is written as a plain line instead.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from libs.cli import follow

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _where(event: dict[str, Any]) -> str:
    node, executor = event.get("node_id"), event.get("executor")
    parts = [str(node)] if node else []
    if executor:
        parts.append(f"on {executor}")
    return " ".join(parts)


def _label(image: int, n: int, p: follow.ImageProgress) -> str:
    head = f"image {image + 1}/{n}: " if n > 1 else ""
    if p.steps:
        return f"{head}step {p.step}/{p.steps}"
    return f"{head}node {p.done}/{p.total}" if p.total else f"{head}running"


class LineReporter:
    """One line per new step (or, for a workflow without a loop, per node)."""

    def __init__(self, console: Console = err) -> None:
        self.console = console
        self.shown: dict[int, tuple[int, int]] = {}

    def node(self, image: int, event: dict[str, Any], progress: follow.Progress) -> None:
        p = progress.images[image]
        key = (p.step, p.done) if not p.steps else (p.step, 0)
        if self.shown.get(image) == key:
            return
        self.shown[image] = key
        where = _where(event)
        self.console.print(f"{_label(image, progress.n, p)}" + (f"  ({where})" if where else ""))

    def note(self, text: str) -> None:
        self.console.print(f"note: {text}")

    def __enter__(self) -> LineReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class BarReporter:
    """A rich progress bar over the call's denoising steps (all images together)."""

    def __init__(self, call_id: str, console: Console = err) -> None:
        self.console = console
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = self.bar.add_task(call_id, total=None, detail="queued")

    def node(self, image: int, event: dict[str, Any], progress: follow.Progress) -> None:
        completed, total = progress.bar()
        p = progress.images[image]
        self.bar.update(
            self.task, completed=completed, total=total or None, detail=_label(image, progress.n, p)
        )

    def note(self, text: str) -> None:
        self.bar.console.print(f"[yellow]note:[/] {text}")

    def __enter__(self) -> BarReporter:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def reporter(call_id: str, quiet: bool) -> BarReporter | LineReporter:
    if quiet:
        return LineReporter(Console(stderr=True, quiet=True))
    return BarReporter(call_id) if err.is_terminal else LineReporter()


# -- tables --------------------------------------------------------------------------------------------
def _ago(created: object) -> str:
    if not isinstance(created, int | float) or isinstance(created, bool):
        return ""
    s = max(0, int(time.time() - created))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


def _cell(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v)
    return str(v)


def _lines(v: object) -> str:
    return "\n".join(str(x) for x in v) if isinstance(v, list) else _cell(v)


def workflows_table(items: list[dict[str, Any]]) -> Table:
    t = Table(title="workflows", title_justify="left")
    for col in ("name", "version", "params", "sizes", "description"):
        t.add_column(col, overflow="fold")
    for w in sorted(items, key=lambda w: str(w.get("name"))):
        t.add_row(*(_cell(w.get(c)) for c in ("name", "version", "params", "sizes", "description")))
    return t


def loras_table(items: list[dict[str, Any]]) -> Table:
    t = Table(title="LoRA adapters", title_justify="left")
    t.add_column("name")
    t.add_column("description", overflow="fold")
    for x in sorted(items, key=lambda x: str(x.get("name"))):
        t.add_row(_cell(x.get("name")), _cell(x.get("description")))
    return t


def requests_table(items: list[dict[str, Any]]) -> Table:
    t = Table(title="recent calls", title_justify="left")
    for col in ("id", "created", "model", "status", "images", "progress", "gpu s"):
        t.add_column(col, justify="right" if col in ("images", "gpu s") else "left")
    for r in items:
        p = r.get("progress") if isinstance(r.get("progress"), dict) else {}
        prog = f"step {p.get('step')}/{p.get('steps')}" if p.get("steps") else ""
        usage = r.get("usage") if isinstance(r.get("usage"), dict) else {}
        gpu = usage.get("gpu_seconds")
        t.add_row(
            _cell(r.get("id")),
            _ago(r.get("created")),
            _cell(r.get("model")),
            _status(r.get("status")),
            f"{_cell(r.get('completed'))}/{_cell(r.get('n'))}",
            prog,
            f"{gpu:.3f}" if isinstance(gpu, int | float) else "",
        )
    return t


STATUS_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan"}


def _status(s: object) -> str:
    style = STATUS_STYLE.get(str(s))
    return f"[{style}]{s}[/]" if style else _cell(s)


def tenants_table(items: list[dict[str, Any]]) -> Table:
    t = Table(title="tenants", title_justify="left")
    cols = ("tenant", "vtime_s", "service_s", "requests", "queued", "ready_nodes", "running_nodes")
    for col in cols:
        t.add_column(col.replace("_", " "), justify="left" if col == "tenant" else "right")
    for x in items:
        t.add_row(*(_cell(x.get(c)) for c in cols))
    return t


def executors_table(items: list[dict[str, Any]] | None, problem: str = "") -> Table:
    t = Table(title="executors", title_justify="left", caption=problem or None)
    for col in ("id", "kind", "running", "busy", "resident (GPU)", "resident (host)", "seen"):
        t.add_column(col, overflow="fold", justify="right" if col in ("running", "busy") else "left")
    for x in items or []:
        busy = x.get("busy")
        t.add_row(
            _cell(x.get("id")),
            _cell(x.get("kind")),
            _cell(x.get("running")),
            f"{busy:.0%}" if isinstance(busy, int | float) else "",
            _lines(x.get("resident")),
            _lines(x.get("host_resident")),
            _ago(x.get("seen")),
        )
    return t


def top_view(tenants: list[dict[str, Any]], executors: list[dict[str, Any]] | None, problem: str) -> Group:
    return Group(tenants_table(tenants), executors_table(executors, problem))
