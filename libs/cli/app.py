"""``t2i``: the gateway's command line for tenants (generate, browse) and operators (register, top).

Every command takes ``--url`` (``T2I_URL``) and ``--api-key`` (``T2I_API_KEY``) itself, so they
may come anywhere on the line. Outside problems (bad arguments, an unreachable gateway, an error
answer) end in one ``error: …`` line on stderr and a non-zero exit — 2 for arguments refused
before anything was sent, 1 for everything else, 130 after Ctrl-C — never a traceback.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from libs.cli import render
from libs.cli.client import DEFAULT_URL, ApiFailure, BadInput, CliError, Gateway, Unreachable
from libs.cli.follow import follow

app = typer.Typer(
    name="t2i",
    help="Generate images and operate a ServerlessT2I platform through its gateway.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Url = Annotated[str, typer.Option("--url", envvar="T2I_URL", help="The gateway's base URL.")]
Key = Annotated[
    str | None,
    typer.Option(
        "--api-key", envvar="T2I_API_KEY", help="API key (Bearer); admin commands need an admin key."
    ),
]
Timeout = Annotated[float, typer.Option("--timeout", min=1.0, help="Seconds to wait for one HTTP answer.")]
Json = Annotated[bool, typer.Option("--json", help="Print the gateway's JSON instead of a table.")]

SIZE = re.compile(r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$")
PARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
EXTENSION = {"png": "png", "jpeg": "jpg", "webp": "webp"}
STATUS_EXIT = {"succeeded": 0, "failed": 1, "cancelled": 1}


def fail(message: str, code: int = 1) -> NoReturn:
    render.err.print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def run(action: Callable[[], int | None]) -> None:
    """Run a command's body, turning every outside problem into one line and an exit status."""
    try:
        code = action()
    except BadInput as e:
        fail(str(e), 2)
    except CliError as e:
        fail(str(e))
    if code:
        raise typer.Exit(code)


def show_json(data: Any) -> None:
    render.out.print_json(json.dumps(data))


# -- generate ---------------------------------------------------------------------------------------
def parse_params(pairs: list[str]) -> dict[str, Any]:
    """``--param name=value`` pairs; a value that reads as JSON (numbers, true, null) is taken as such."""
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not PARAM_NAME.match(name):
            raise typer.BadParameter(
                f"expected NAME=VALUE with a parameter name, got {pair!r}", param_hint="--param"
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, dict | list):
            value = raw
        params[name] = value
    return params


def output_paths(out: Path | None, call_id: str, n: int, fmt: str) -> list[Path]:
    """Where each image goes: ``--out`` (numbered ``-1``, ``-2``… for several), a directory, or
    ``t2i-<id>[-i].<ext>`` in the working directory."""
    ext = EXTENSION[fmt]
    if out is not None and out.is_dir():
        base = out / f"t2i-{call_id}.{ext}"
    else:
        base = out if out is not None else Path(f"t2i-{call_id}.{ext}")
    if n == 1:
        return [base]
    return [base.with_name(f"{base.stem}-{i + 1}{base.suffix}") for i in range(n)]


def image_bytes(gw: Gateway, item: Any, index: int) -> bytes:
    if not isinstance(item, dict):
        raise CliError(f"image {index + 1} of the answer is not an object")
    if isinstance(item.get("b64_json"), str):
        try:
            return base64.b64decode(item["b64_json"], validate=True)
        except (binascii.Error, ValueError):
            raise CliError(f"image {index + 1}: b64_json is not valid base64") from None
    if isinstance(item.get("url"), str):
        return gw.download(item["url"])
    raise CliError(f"image {index + 1} of the answer has neither b64_json nor url")


def finish(gw: Gateway, status: dict[str, Any], paths: list[Path], as_json: bool) -> int:
    """Save a finished call's images and report; the exit status follows the call's."""
    state = status.get("status")
    call_id = str(status.get("id", ""))
    if state == "succeeded" and not status.get("data") and call_id:
        status = gw.get(f"/v1/requests/{call_id}")  # the final event may leave the images out
    saved: list[str] = []
    if status.get("status", state) == "succeeded" or (state is None and status.get("data")):
        data = status.get("data") or []
        if len(data) != len(paths):
            raise CliError(f"the gateway answered {len(data)} images, {len(paths)} were asked for")
        for i, (item, path) in enumerate(zip(data, paths, strict=True)):
            content = image_bytes(gw, item, i)
            try:
                path.write_bytes(content)
            except OSError as e:
                raise CliError(f"cannot write {path}: {e.strerror or e}") from None
            saved.append(str(path))
    usage = status.get("usage") if isinstance(status.get("usage"), dict) else {}
    gpu = usage.get("gpu_seconds")
    if as_json:
        summary = {k: v for k, v in status.items() if k != "data"}
        show_json({**summary, "files": saved})
    else:
        for path in saved:
            render.out.print(f"saved {path}")
        per = usage.get("gpu_seconds_per_image")
        detail = ""
        if isinstance(per, list) and len(per) > 1:
            detail = " (" + " + ".join(f"{x:.3f}" for x in per if isinstance(x, int | float)) + ")"
        render.out.print(
            f"gpu_seconds: {gpu:.3f}{detail}" if isinstance(gpu, int | float) else "gpu_seconds: not reported"
        )
    final = status.get("status", state or "succeeded")
    if final != "succeeded":
        err = status.get("error") if isinstance(status.get("error"), dict) else {}
        why = err.get("message") or "no reason given"
        render.err.print(f"[red]call {call_id} {final}:[/] {escape(str(why))}")
    return STATUS_EXIT.get(str(final), 1)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Workflow name (see `t2i workflows`).")],
    size: Annotated[str | None, typer.Option(help="WIDTHxHEIGHT or auto (workflows with a size).")] = None,
    steps: Annotated[int | None, typer.Option(min=1, max=1000, help="Denoising steps.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, max=2**63 - 1, help="Seed (random when absent).")] = None,
    n: Annotated[int, typer.Option("--n", "-n", min=1, max=64, help="Images to generate.")] = 1,
    guidance: Annotated[float | None, typer.Option(help="Guidance scale.")] = None,
    param: Annotated[list[str] | None, typer.Option(help="Any other workflow parameter, NAME=VALUE.")] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="File (numbered for several) or directory.")
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option("--format", help="png, jpeg or webp (default: from --out's suffix, else png)."),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: Json = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """Generate images: submit asynchronously, show progress over denoising steps, save the files."""
    body, fmt = _image_body(prompt, model, size, steps, seed, n, guidance, param, out, fmt)
    run(
        lambda: _images(
            "/v1/images/generations", body, None, out, n, fmt, quiet, as_json, url, api_key, timeout
        )
    )


@app.command()
def edit(
    prompt: Annotated[str, typer.Argument(help="What to change (or, for img2img, what to draw).")],
    image: Annotated[
        list[Path], typer.Option("--image", "-i", help="The picture to edit (repeat for several).")
    ],
    model: Annotated[
        str,
        typer.Option("--model", "-m", help="An edit-capable workflow (`capabilities` in `t2i workflows`)."),
    ],
    mask: Annotated[
        Path | None, typer.Option(help="A PNG of the image's size whose transparent pixels are repainted.")
    ] = None,
    strength: Annotated[
        float | None, typer.Option(min=0.0, max=1.0, help="How much of the schedule runs (img2img).")
    ] = None,
    size: Annotated[str | None, typer.Option(help="WIDTHxHEIGHT or auto (workflows with a size).")] = None,
    steps: Annotated[int | None, typer.Option(min=1, max=1000, help="Denoising steps.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, max=2**63 - 1, help="Seed (random when absent).")] = None,
    n: Annotated[int, typer.Option("--n", "-n", min=1, max=64, help="Images to make.")] = 1,
    guidance: Annotated[float | None, typer.Option(help="Guidance scale.")] = None,
    param: Annotated[list[str] | None, typer.Option(help="Any other workflow parameter, NAME=VALUE.")] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="File (numbered for several) or directory.")
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option("--format", help="png, jpeg or webp (default: from --out's suffix, else png)."),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: Json = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """Edit images (POST /v1/images/edits): upload the picture (and a mask), show progress, save."""
    body, fmt = _image_body(prompt, model, size, steps, seed, n, guidance, param, out, fmt)
    if strength is not None:
        body["strength"] = strength
    files = [("image[]" if len(image) > 1 else "image", _upload(p, "--image")) for p in image]
    if mask is not None:
        files.append(("mask", _upload(mask, "--mask")))
    run(lambda: _images("/v1/images/edits", body, files, out, n, fmt, quiet, as_json, url, api_key, timeout))


def _upload(path: Path, option: str) -> tuple[str, bytes, str]:
    """A file to upload: (name, bytes, content type from its suffix)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise typer.BadParameter(f"cannot read {str(path)!r}: {e.strerror}", param_hint=option) from None
    ctype = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
    return path.name, data, ctype.get(path.suffix.lower(), "application/octet-stream")


def _image_body(
    prompt: str,
    model: str,
    size: str | None,
    steps: int | None,
    seed: int | None,
    n: int,
    guidance: float | None,
    param: list[str] | None,
    out: Path | None,
    fmt: str | None,
) -> tuple[dict[str, Any], str]:
    """The fields a generation or an edit sends, checked; and the output format."""
    if not prompt.strip():
        raise typer.BadParameter("must not be empty", param_hint="PROMPT")
    if size is not None and not SIZE.match(size):
        raise typer.BadParameter(
            f"expected WIDTHxHEIGHT (e.g. 512x512) or auto, got {size!r}", param_hint="--size"
        )
    if fmt is None:
        fmt = FORMATS.get(out.suffix.lower(), "png") if out is not None and not out.is_dir() else "png"
    if fmt not in EXTENSION:
        raise typer.BadParameter(f"must be png, jpeg or webp, got {fmt!r}", param_hint="--format")
    target_dir = out if out is not None and out.is_dir() else (out.parent if out is not None else Path("."))
    if not target_dir.is_dir():
        raise typer.BadParameter(f"directory {str(target_dir)!r} does not exist", param_hint="--out")
    body: dict[str, Any] = {"model": model, "prompt": prompt, "n": n, "response_format": "b64_json"}
    extra = parse_params(param or [])
    for name, value in (
        ("size", size),
        ("seed", seed),
        ("num_inference_steps", steps),
        ("guidance_scale", guidance),
    ):
        if value is not None:
            body[name] = value
    if fmt != "png":
        body["output_format"] = fmt
    if extra:
        body["params"] = extra
    return body, fmt


def _images(
    path: str,
    body: dict[str, Any],
    files: list[tuple[str, tuple[str, bytes, str]]] | None,
    out: Path | None,
    n: int,
    fmt: str,
    quiet: bool,
    as_json: bool,
    url: str,
    api_key: str | None,
    timeout: float,
) -> int:
    """Submit asynchronously, follow the call's progress, save its images."""
    with Gateway(url, api_key, timeout) as gw:
        status, headers, answer = gw.call(
            "POST", path, body, headers={"Prefer": "respond-async"}, files=files
        )
        call_id = str(answer.get("id") or "")
        if not call_id or not re.fullmatch(r"[0-9A-Za-z_-]{1,128}", call_id):
            raise CliError("the gateway's answer carries no valid call id")
        paths = output_paths(out, call_id, n, fmt)
        if status != 202:  # a gateway that ignores the preference answered synchronously
            if not quiet:
                render.err.print("note: the gateway answered synchronously (no progress to show)")
            return finish(gw, answer, paths, as_json)
        if not quiet and not as_json:
            render.err.print(f"call {call_id} queued")
        try:
            with render.reporter(call_id, quiet or as_json) as rep:
                final = follow(gw, call_id, n, rep)
        except KeyboardInterrupt:
            render.err.print(f"interrupted: cancelling call {call_id}")
            try:
                gw.call("POST", f"/v1/requests/{call_id}/cancel")
            except CliError as e:
                render.err.print(f"could not cancel {call_id}: {e}")
            return 130
        return finish(gw, final, paths, as_json)


# -- catalog -----------------------------------------------------------------------------------------
@app.command()
def workflows(
    name: Annotated[str | None, typer.Argument(help="Show this workflow's spec instead of the list.")] = None,
    version: Annotated[int | None, typer.Option(min=1, help="With NAME: this version.")] = None,
    as_json: Json = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """List the registered workflows (or show one's spec)."""

    def action() -> None:
        with Gateway(url, api_key, timeout) as gw:
            if name is not None:
                show_json(gw.get(f"/v1/workflows/{name}", version=version).get("workflow"))
                return
            data = gw.get("/v1/workflows").get("data") or []
            show_json(data) if as_json else render.out.print(render.workflows_table(data))

    run(action)


@app.command()
def register(
    spec: Annotated[
        Path, typer.Argument(help="A workflow spec (JSON file), or - for stdin.", allow_dash=True)
    ],
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """Register a workflow spec (admin). A changed spec under an existing name becomes a new version."""
    try:
        text = typer.get_text_stream("stdin").read() if str(spec) == "-" else spec.read_text()
    except OSError as e:
        raise typer.BadParameter(f"cannot read {spec}: {e.strerror or e}", param_hint="SPEC") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"{spec} is not JSON: {e}", param_hint="SPEC") from None
    if not isinstance(body, dict):
        raise typer.BadParameter(f"{spec} must hold a JSON object (a workflow spec)", param_hint="SPEC")

    def action() -> None:
        with Gateway(url, api_key, timeout) as gw:
            status, _, answer = gw.call("POST", "/v1/workflows", body)
            wf = answer.get("workflow") or {}
            verb = "registered" if answer.get("created", status == 201) else "already registered"
            render.out.print(f"{verb} workflow {wf.get('name')} version {wf.get('version')}")

    run(action)


@app.command()
def loras(
    as_json: Json = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """List the registered LoRA adapters."""

    def action() -> None:
        with Gateway(url, api_key, timeout) as gw:
            data = gw.get("/v1/loras").get("data") or []
            show_json(data) if as_json else render.out.print(render.loras_table(data))

    run(action)


# -- calls -------------------------------------------------------------------------------------------
@app.command()
def requests(
    limit: Annotated[int, typer.Option(min=1, max=1000, help="How many recent calls.")] = 20,
    tenant: Annotated[
        str | None, typer.Option(help="Admin keys: another tenant's calls, or * for everyone's.")
    ] = None,
    as_json: Json = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """Your recent generation calls, newest first."""

    def action() -> None:
        with Gateway(url, api_key, timeout) as gw:
            data = gw.get("/v1/requests", limit=limit, tenant=tenant).get("data") or []
            show_json(data) if as_json else render.out.print(render.requests_table(data))

    run(action)


@app.command()
def cancel(
    call_id: Annotated[str, typer.Argument(metavar="ID", help="The call's id (from generate or requests).")],
    as_json: Json = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 30.0,
) -> None:
    """Cancel a call: queued images are dropped, running ones stop after their current node."""
    if not re.fullmatch(r"[0-9A-Za-z_-]{1,128}", call_id):
        raise typer.BadParameter(f"not a call id: {call_id[:80]!r}", param_hint="ID")

    def action() -> None:
        with Gateway(url, api_key, timeout) as gw:
            _, _, status = gw.call("POST", f"/v1/requests/{call_id}/cancel")
            if as_json:
                show_json({k: v for k, v in status.items() if k != "data"})
                return
            usage = status.get("usage") if isinstance(status.get("usage"), dict) else {}
            gpu = usage.get("gpu_seconds")
            charged = f", {gpu:.3f} GPU-seconds charged" if isinstance(gpu, int | float) else ""
            render.out.print(f"call {call_id}: {status.get('status')}{charged}")

    run(action)


# -- operators ---------------------------------------------------------------------------------------
def _top_data(gw: Gateway) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]:
    tenants = gw.get("/v1/admin/tenants").get("data") or []
    try:
        executors = gw.get("/v1/admin/executors").get("data") or []
        return tenants, executors, ""
    except ApiFailure as e:  # the tenants are still worth showing
        if e.status in (401, 403):
            raise
        return tenants, None, f"executors unavailable: {e}"


@app.command()
def top(
    interval: Annotated[float, typer.Option(min=0.2, max=3600, help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    url: Url = DEFAULT_URL,
    api_key: Key = None,
    timeout: Timeout = 10.0,
) -> None:
    """Live operator view (admin): tenants' vTime and queues; executors and their resident models."""

    def action() -> int:
        with Gateway(url, api_key, timeout) as gw:
            if once or not render.out.is_terminal:
                render.out.print(render.top_view(*_top_data(gw)))
                return 0
            good = render.top_view(*_top_data(gw))  # a first failure (no admin key) ends here
            try:
                with Live(good, console=render.out, auto_refresh=False) as live:
                    while True:
                        time.sleep(interval)
                        try:
                            good = view = render.top_view(*_top_data(gw))
                        except Unreachable as e:  # a gateway restarting: keep watching
                            view = Group(good, Text(f"stale: {e}", style="yellow"))
                        live.update(view, refresh=True)
            except KeyboardInterrupt:
                return 0

    run(action)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
