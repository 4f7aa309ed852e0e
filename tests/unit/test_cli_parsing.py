"""The ``t2i`` command line's own logic: argument checks (typer's CliRunner), the event-stream
parser, progress folding, and how it copes with a gateway older than itself.

The older gateway is a real HTTP server on a loopback port (``http.server`` in a thread) that
answers the way a gateway without the event and cancel routes does: ``Prefer: respond-async``
accepted, ``/events`` answered 404 ``no route …``. The CLI must still finish the call, by polling.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from libs.cli import sse
from libs.cli.app import app, output_paths, parse_params
from libs.cli.client import ApiFailure
from libs.cli.follow import Progress

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
runner = CliRunner()


# -- arguments --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["generate", "a fox"], "--model"),
        (["generate", "-m", "wf", "a fox", "--size", "512"], "--size"),
        (["generate", "-m", "wf", "a fox", "--steps", "0"], "--steps"),
        (["generate", "-m", "wf", "a fox", "-n", "0"], "-n"),
        (["generate", "-m", "wf", "a fox", "--format", "gif"], "--format"),
        (["generate", "-m", "wf", "a fox", "--param", "=3"], "--param"),
        (["generate", "-m", "wf", "   "], "PROMPT"),
        (["cancel", "not/an/id"], "ID"),
        (["workflows", "--url", "ftp://gateway"], "T2I_URL"),
        (["workflows", "--api-key", "has space"], "T2I_API_KEY"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(args, names):
    result = runner.invoke(app, args, env={"T2I_URL": "http://127.0.0.1:9"})
    assert result.exit_code == 2, result.output
    assert names in result.output


def test_params_read_json_values_and_keep_other_text():
    assert parse_params(["strength=0.5", "mode=fast", "on=true", "n=null", 'obj={"a":1}']) == {
        "strength": 0.5,
        "mode": "fast",
        "on": True,
        "n": None,
        "obj": '{"a":1}',
    }


def test_output_paths(tmp_path):
    assert output_paths(None, "abc", 1, "png") == [Path("t2i-abc.png")]
    assert output_paths(tmp_path / "x.jpg", "abc", 2, "jpeg") == [tmp_path / "x-1.jpg", tmp_path / "x-2.jpg"]
    assert output_paths(tmp_path, "abc", 1, "webp") == [tmp_path / "t2i-abc.webp"]


# -- event streams and progress ------------------------------------------------------------------------
def test_sse_parser_follows_the_event_stream_rules():
    lines = [
        ": ping",
        "id: 0:1-0",
        "event: node",
        'data: {"step": 1,',
        'data:  "steps": 4}',
        "",
        "",
        "retry: 100",
        "data:plain",
        "",
        "event: done",
        "data: {}",  # no blank line after it: the stream broke off mid-event
    ]
    events = list(sse.parse(lines))
    assert events == [
        sse.Event("node", '{"step": 1,\n "steps": 4}', "0:1-0"),
        sse.Event("message", "plain", None),
    ]


def test_progress_folds_images_into_steps_and_estimates_unseen_ones():
    p = Progress(n=2)
    p.update(0, {"step": 3, "steps": 4, "done": 5, "total": 8})
    assert p.bar() == (3, 8)  # image 2 not heard of yet: counted like image 1
    p.update(1, {"step": 1, "steps": 4})
    p.update(1, {"step": 0, "steps": 4})  # an event out of order never moves progress back
    assert p.bar() == (4, 8)
    loopless = Progress(n=1)
    loopless.update(0, {"done": 2, "total": 3, "steps": 0})
    assert loopless.bar() == (2, 3)


def test_a_missing_route_is_told_apart_from_a_missing_object():
    route = ApiFailure(404, "no route GET /v1/requests/x/events", method="GET", path="/v1/requests/x/events")
    assert route.route_missing and "upgrade the gateway" in str(route)
    obj = ApiFailure(404, "no request 'x'", "not_found", "id")
    assert not obj.route_missing and str(obj) == "no request 'x' [id] (HTTP 404, not_found)"


# -- a gateway older than the CLI --------------------------------------------------------------------------
class OldGateway(BaseHTTPRequestHandler):
    """Accepts async calls but has no event stream and no cancel route; a call runs for 3 polls."""

    polls = 0

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _no_route(self) -> None:
        self._json(404, {"error": {"message": f"no route {self.command} {self.path}", "code": None}})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/images/generations":
            self._json(202, {"id": "c" * 20, "status": "queued", "n": 1})
        else:
            self._no_route()

    def do_GET(self) -> None:
        if self.path == "/v1/requests/" + "c" * 20:
            OldGateway.polls += 1
            done = OldGateway.polls >= 3
            body = {
                "id": "c" * 20,
                "status": "succeeded" if done else "running",
                "n": 1,
                "progress": {
                    "nodes_done": OldGateway.polls,
                    "nodes_total": 3,
                    "step": OldGateway.polls,
                    "steps": 3,
                },
                "usage": {"gpu_seconds": 1.25},
            }
            if done:
                body["data"] = [{"b64_json": base64.b64encode(PNG).decode()}]
            self._json(200, body)
        else:
            self._no_route()


@pytest.fixture
def old_gateway() -> Iterator[str]:
    OldGateway.polls = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), OldGateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_generate_falls_back_to_polling_when_the_gateway_has_no_event_stream(old_gateway, tmp_path):
    out = tmp_path / "fox.png"
    result = runner.invoke(app, ["generate", "-m", "wf", "a fox", "-o", str(out), "--url", old_gateway])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == PNG
    assert "does not offer GET /v1/requests/" in result.output and "polling" in result.output
    assert "step 3/3" in result.output and "gpu_seconds: 1.250" in result.output


def test_commands_on_missing_routes_say_the_gateway_is_older(old_gateway):
    for args in (["requests"], ["cancel", "c" * 20], ["top", "--once"]):
        result = runner.invoke(app, [*args, "--url", old_gateway, "--api-key", "sk-x"])
        assert result.exit_code == 1, result.output
        assert "this gateway does not offer" in result.output and "upgrade the gateway" in result.output
