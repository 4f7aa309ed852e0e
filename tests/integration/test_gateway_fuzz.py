"""A bounded fuzz of every gateway route (hypothesis): random methods, paths, headers and bodies
against a running platform never get a 5xx, and a good request still succeeds afterwards.

The stack is the one of ``test_gateway_stack.py`` with only ``fast-wf`` registered (a body that
happens to be valid completes in milliseconds). Bodies are raw bytes, JSON of any shape, and valid
generation and registration bodies with fields replaced by arbitrary values; headers include
non-UTF-8 bytes. The run is bounded by example count and by a wall-clock budget (< 30 s).
"""

from __future__ import annotations

import base64
import http.client
import json
import time
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.integration.test_gateway_stack import PNG_MAGIC, call, gen, start_stack, stop_stack

BUDGET_S = 25.0
KEYS = ["sk-alice", "sk-bob", "sk-ops", "nope", ""]
ROUTE_PATHS = [
    "/v1/images/generations",
    "/v1/requests/{id}",
    "/v1/images/files/{id}/{name}",
    "/v1/workflows",
    "/v1/workflows/{name}",
    "/v1/loras",
    "/v1/loras/{name}",
    "/v1/admin/tenants",
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/models",
    "/v1/models/{name}",
    "/openapi.json",
    "/v1/images/edits",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(broker_urls, tmp_path_factory.mktemp("gw-fuzz"), ("fast",))
    yield s
    stop_stack(s, broker_urls)


# -- strategies ----------------------------------------------------------------------------------------
def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of ``choices``, each drawn in proportion to its weight."""
    pool = [s for w, s in choices for _ in range(w)]
    return st.integers(0, len(pool) - 1).flatmap(lambda i: pool[i])


def segments(known: list[str]) -> st.SearchStrategy[str]:
    return weighted(
        (6, st.sampled_from(known)),
        (2, st.sampled_from(["nope", "..", ".", "%2F", "%00", "%ff", "a" * 300, "x.png", "-0"])),
        (
            1,
            st.text(
                st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#%"), min_size=1
            ),
        ),
        (1, st.binary(min_size=1, max_size=12).map(lambda b: "".join(f"%{c:02X}" for c in b))),
    )


@st.composite
def paths(draw, known: list[str]) -> str:
    template = draw(
        weighted(
            (4, st.just(ROUTE_PATHS[0])),  # the generation route, where most of the checking is
            (2, st.sampled_from(ROUTE_PATHS[1:3])),
            (4, st.sampled_from(ROUTE_PATHS[3:])),
            (1, st.just("/{id}/{name}/{name}")),
        )
    )
    path = template.replace("{id}", draw(segments(known))).replace("{name}", draw(segments(known)))
    if draw(st.integers(0, 4)) == 0:
        path += "?" + draw(
            st.sampled_from(["version=1", "version=x", "version=%C2%B2", "version=" + "9" * 50, "a=%ff"])
        )
    return path


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
    ),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
GOOD_BODIES = [
    gen(),
    gen(n=2, seed=5, response_format="url"),
    {"model": "fast-wf", "prompt": "x", "params": {"num_inference_steps": 2}},
    {"name": "style-x", "path": "loras/x.safetensors", "description": "d"},
]
FIELDS = sorted(
    {k for b in GOOD_BODIES for k in b}
    | {"n", "size", "seed", "guidance_scale", "user", "output_format", "output_compression"}
)


@st.composite
def mutated(draw) -> bytes:
    body = dict(draw(st.sampled_from(GOOD_BODIES)))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(weighted((4, st.sampled_from(FIELDS)), (1, st.text(max_size=8))))
        body[key] = draw(json_values)
    return json.dumps(body).encode()


bodies = weighted(  # the first choice is drawn most (hypothesis favours small indices): the richest
    (6, mutated()),
    (2, json_values.map(lambda v: json.dumps(v).encode())),
    (1, st.binary(max_size=200)),
    (
        1,
        st.sampled_from(
            [
                b'{"model": "fast-wf", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
                b"[" * 1000 + b"]" * 1000,
                b'{"model": "fast-wf", "prompt": NaN}',
                b'{"model": "fast-wf", "prompt": "\xff"}',
                b'{"model": "fast-wf", "prompt": "\\udfff"}',
            ]
        ),
    ),
    (1, st.none()),
)
header_value = st.one_of(
    st.text(st.characters(codec="latin-1", exclude_characters="\r\n\x00"), max_size=40),
    st.binary(max_size=20).filter(lambda b: not set(b) & {0, 10, 13}),
)
methods = weighted(
    (5, st.just("POST")),
    (4, st.just("GET")),
    (1, st.sampled_from(["PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])),
    (1, st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=7)),
)


@st.composite
def headers(draw) -> dict[str, str | bytes]:
    out: dict[str, str | bytes] = {}
    auth = draw(
        weighted(
            (8, st.sampled_from(KEYS[:3]).map(lambda k: f"Bearer {k}")),
            (1, st.sampled_from(KEYS[3:]).map(lambda k: f"Bearer {k}")),
            (1, header_value.map(lambda v: b"Bearer " + v if isinstance(v, bytes) else "Bearer " + v)),
            (1, st.one_of(header_value, st.none())),
        )
    )
    if auth is not None:
        out["Authorization"] = auth
    out["Content-Type"] = draw(weighted((8, st.just("application/json")), (1, header_value)))
    for name in ("Idempotency-Key", "Accept", "X-Anything"):
        if draw(st.integers(0, 3)) == 0:
            out[name] = draw(weighted((2, st.sampled_from(["k-1", "k-2"])), (1, header_value)))
    return out


def send(port: int, method: str, path: str, hdrs: dict, body: bytes | None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in hdrs.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body or None)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_random_calls_to_every_route_never_get_a_5xx_and_the_gateway_keeps_serving(stack):
    made = call(stack, "POST", "/v1/images/generations", gen(response_format="url"))
    assert made.status == 200, made.body
    image = made.body["data"][0]["url"].rsplit("/", 2)  # [..., request id, file name]
    known = ["fast-wf", "style-x", made.body["id"], image[1], image[2], uuid.uuid4().hex[:20]]
    started = time.monotonic()
    seen: dict[int, int] = {}

    @settings(
        max_examples=1000,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(method=methods, path=paths(known), hdrs=headers(), body=bodies)
    def one(method: str, path: str, hdrs: dict, body: bytes | None) -> None:
        if time.monotonic() - started > BUDGET_S:
            return  # the budget is spent: the remaining examples pass without a call
        status = send(stack.gateway_port, method, path, hdrs, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (method, path, hdrs, body[:300] if body else body, status)

    one()
    assert sum(seen.values()) >= 100, seen  # the budget allowed a real run
    assert {200, 400, 401, 404, 422} <= seen.keys(), seen  # the calls reached every layer
    good = call(stack, "POST", "/v1/images/generations", gen(seed=1))
    assert good.status == 200, good.body
    assert base64.b64decode(good.body["data"][0]["b64_json"]).startswith(PNG_MAGIC)
    assert call(stack, "GET", "/readyz", key=None).status == 200
    assert "unhandled error" not in stack.read_log("gateway")


# -- POST /v1/images/edits: multipart forms ------------------------------------------------------------
def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


FILES = [
    _png((32, 32)),
    _png((32, 32), "RGBA"),
    _png((16, 8)),
    _png((4, 4)),
    _png((32, 32))[:60],
    b"GIF89a",
    b"",
]
FORM_FIELDS = [
    "model",
    "prompt",
    "n",
    "size",
    "seed",
    "strength",
    "response_format",
    "output_format",
    "params",
]
FILE_TYPES = ["image/png", "image/jpeg", "application/octet-stream", "text/plain", ""]


@st.composite
def edit_forms(draw) -> tuple[str, bytes]:
    """A multipart form (content type, body): good parts, mutated ones, strange names and headers."""
    boundary = "fuzzb0undary"
    parts: list[bytes] = []

    def part(name: str, data: bytes, filename: str | None = None, ctype: str | None = None) -> None:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        head = f"Content-Disposition: {disp}\r\n" + (f"Content-Type: {ctype}\r\n" if ctype else "")
        parts.append(f"--{boundary}\r\n{head}\r\n".encode() + data + b"\r\n")

    fields = {"model": "edit-wf", "prompt": "a hat"}
    for _ in range(draw(st.integers(0, 3))):
        fields[draw(st.sampled_from([*FORM_FIELDS, "x", "params[seed]", "image"]))] = draw(
            st.one_of(st.text(max_size=20), st.sampled_from(["2", "-1", "0.5", "nan", "{}", "[1]", "auto"]))
        )
    for name, value in fields.items():
        part(name, value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value)
    for name in draw(st.lists(st.sampled_from(["image", "image[]", "mask", "image"]), max_size=4)):
        part(name, draw(st.sampled_from(FILES)), "f.png", draw(st.sampled_from(FILE_TYPES)))
    body = b"".join(parts)
    if draw(st.integers(0, 5)):
        body += f"--{boundary}--\r\n".encode()  # else: a form that never ends
    if not draw(st.integers(0, 9)):
        body = body[: draw(st.integers(0, len(body)))]  # cut anywhere
    ctype = draw(
        weighted(
            (8, st.just(f"multipart/form-data; boundary={boundary}")),
            (1, st.sampled_from(["multipart/form-data", "application/json", "multipart/mixed; boundary=x"])),
        )
    )
    return ctype, body


def test_random_edit_forms_never_get_a_5xx_and_edits_keep_working(stack):
    spec = json.loads(encode_spec(sim_workflow("edit-wf", "fast", steps=2)))
    spec["params"]["image"] = {"type": "image", "required": True}
    spec["params"]["mask"] = {"type": "image"}
    spec["params"]["strength"] = {"type": "float", "default": 0.8, "minimum": 0.0, "maximum": 1.0}
    status, body = stack.http("POST", "/v1/workflows", spec, key="sk-ops")
    assert status in (200, 201), body
    started = time.monotonic()
    seen: dict[int, int] = {}

    @settings(
        max_examples=400,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(form=edit_forms())
    def one(form: tuple[str, bytes]) -> None:
        if time.monotonic() - started > BUDGET_S / 2:
            return
        ctype, data = form
        hdrs = {"Authorization": "Bearer sk-alice", "Content-Type": ctype, "Prefer": "respond-async"}
        status = send(stack.gateway_port, "POST", "/v1/images/edits", hdrs, data)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (ctype, data[:300], status)

    one()
    assert sum(seen.values()) >= 50, seen
    assert {400, 422} <= seen.keys(), seen
    ok = _good_edit(stack.gateway_port)
    assert ok == 200


def _good_edit(port: int) -> int:
    boundary = "okb0undary"
    fields = [("model", b"edit-wf", None), ("prompt", b"a hat", None), ("image", _png((32, 32)), "a.png")]
    body = (
        b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"'.encode()
            + (f'; filename="{f}"\r\nContent-Type: image/png'.encode() if f else b"")
            + b"\r\n\r\n"
            + v
            + b"\r\n"
            for n, v, f in fields
        )
        + f"--{boundary}--\r\n".encode()
    )
    hdrs = {"Authorization": "Bearer sk-alice", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    return send(port, "POST", "/v1/images/edits", hdrs, body)
