"""The web console in a real browser (Debian's headless Chromium, driven by playwright) against a
running stack with simulated executors: the page loads from the gateway, a generation submitted
from the playground completes while its node events arrive, the image shows, and the operator view
lists tenants, executors and the request. Screenshots go to ``out/test-artifacts/`` (git-ignored).

``make test`` installs Chromium (``make browser``) when it is missing; without it the browser tests
are skipped with the reason shown. No browser is downloaded: playwright drives ``/usr/bin/chromium``.
"""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.launcher.stack import Stack
from libs.sim.workflows import sim_workflow
from libs.workflow.spec import encode_spec
from tests.conftest import REPO
from tests.support.stacks import sim_stack, started
from tests.support.toyprofile import write_family_profile

pytestmark = pytest.mark.e2e

KEYS = "sk-alice=alice,sk-ops=ops:admin"
STEPS = 4
ARTIFACTS = REPO / "out" / "test-artifacts"


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def write_profile(path: Path) -> None:
    """Denoising steps of a quarter second: the page sees events arrive before the call ends."""
    write_family_profile(path, {"console": 0.25}, load_s=0.01)


def call(stack: Stack, method: str, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.gateway_port, timeout=30)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def stack(broker_urls, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("console")
    write_profile(tmp / "profile.json")
    s = sim_stack(
        tmp,
        sim_profile=str(tmp / "profile.json"),
        api_keys=KEYS,
        nats_url=broker_urls[0],
        redis_url=broker_urls[1],
    )
    with started(s):
        spec = json.loads(
            encode_spec(sim_workflow("console-wf", "console", steps=STEPS, description="console test"))
        )
        status, body = s.http("POST", "/v1/workflows", spec, key="sk-ops")
        assert status == 201, body
        edit = json.loads(
            encode_spec(sim_workflow("console-edit", "console", steps=2, description="an editor"))
        )
        edit["params"]["image"] = {"type": "image", "required": True}
        edit["params"]["mask"] = {"type": "image"}
        edit["params"]["strength"] = {"type": "float", "default": 0.8, "minimum": 0, "maximum": 1}
        status, body = s.http("POST", "/v1/workflows", edit, key="sk-ops")
        assert status == 201, body
        yield s


def test_console_is_served_without_a_key(stack):
    status, headers, body = call(stack, "GET", "/console")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"/console/app.js" in body
    assert "script-src 'self'" in headers["content-security-policy"]  # nothing from elsewhere runs
    for name, kind in (
        ("app.js", "text/javascript"),
        ("dag.js", "text/javascript"),
        ("style.css", "text/css"),
    ):
        status, headers, body = call(stack, "GET", f"/console/{name}")
        assert status == 200 and headers["content-type"].startswith(kind) and body
    for bad in ("/console/nope.js", "/console/__init__.py", "/console/..%2Fapp.py"):
        status, _, body = call(stack, "GET", bad)
        assert status == 404, bad
        assert json.loads(body)["error"]["message"]
    assert call(stack, "GET", "/v1/workflows")[0] == 401  # the API still needs a key


@pytest.fixture
def page(stack):
    exe = chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: `make browser` (apt-get install -y chromium) installs it")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (the test extra)"
    )
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=exe, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            pg = browser.new_page(viewport={"width": 1360, "height": 1000})
            # Script errors, console errors (a CSP violation logs one) and failed loads, for the
            # tests to assert there are none.
            errors: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            pg.errors = errors  # type: ignore[attr-defined]
            pg.set_default_timeout(60_000)
            yield pg
        finally:
            browser.close()


def use_key(page, key: str) -> None:
    page.fill("#api-key", key)
    page.click("#save-key")
    page.wait_for_selector("#key-state:has-text('✓')")


def test_a_generation_from_the_playground_completes_and_shows(stack, page):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.goto(stack.url + "/console")
    use_key(page, "sk-alice")
    page.wait_for_selector("#workflow option[value='console-wf']", state="attached")
    page.select_option("#workflow", "console-wf")
    page.fill("#prompt", "a lighthouse at dusk")
    page.fill("#steps", str(STEPS))
    page.fill("#seed", "7")
    page.click("#generate")

    # The DAG fills in from the node events the page reads off /v1/requests/{id}/events.
    page.wait_for_selector("#gen-dag g.node.done")
    # (selectors, not wait_for_function: the page's CSP forbids the eval that would need)
    page.wait_for_selector(
        ",".join(f"#status[data-status={s}]" for s in ("succeeded", "failed", "cancelled"))
    )
    assert page.text_content("#status") == "succeeded", page.text_content("#error")
    gen_id = page.text_content("#gen-id")
    assert gen_id and len(gen_id) == 20

    width = page.eval_on_selector("#images img", "img => img.complete && img.naturalWidth")
    assert width and width > 0
    # The DAG: text, prepare, STEPS denoising steps, vae — all done, with their timings listed.
    nodes = page.eval_on_selector_all(
        "#gen-dag g.node", "gs => gs.map(g => [g.dataset.node, g.classList[1]])"
    )
    assert [n for n, _ in nodes] == ["text", "prepare", *(f"dit@{i}" for i in range(STEPS)), "vae"]
    assert {s for _, s in nodes} == {"done"}
    timed = page.eval_on_selector_all("#gen-timings tbody tr", "rows => rows.map(r => r.dataset.node)")
    assert sorted(timed) == sorted(n for n, _ in nodes)
    assert page.text_content("#step-text") == f"{STEPS} / {STEPS}"
    page.screenshot(path=str(ARTIFACTS / "console.png"), full_page=True)
    assert not page.errors, page.errors  # type: ignore[attr-defined]

    # Two images: both shown, every node done for both (the timings list each image's nodes).
    page.fill("#n", "2")
    page.fill("#seed", "")
    page.click("#generate")
    page.wait_for_selector(f"#gen-id:not(:text-is('{gen_id}'))")
    page.wait_for_selector(
        ",".join(f"#status[data-status={s}]" for s in ("succeeded", "failed", "cancelled"))
    )
    assert page.text_content("#status") == "succeeded", page.text_content("#error")
    widths = page.eval_on_selector_all("#images img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
    assert len(widths) == 2 and all(w > 0 for w in widths)
    assert {s for s in page.eval_on_selector_all("#gen-dag g.node", "gs => gs.map(g => g.classList[1])")} == {
        "done"
    }
    assert len(page.query_selector_all("#gen-timings tbody tr")) == 2 * len(nodes)

    # The operator view (an admin key): the tenant's vTime, the executors, the request in the list.
    use_key(page, "sk-ops")
    page.click("#tab-operator")
    page.wait_for_selector("#tenants td:text-is('alice')")
    vtime = page.eval_on_selector(
        "#tenants tbody",
        "b => [...b.rows].find(r => r.cells[0].textContent === 'alice').cells[1].textContent",
    )
    assert float(vtime) > 0
    page.wait_for_selector("#executors tbody tr:nth-child(2)")
    row = page.wait_for_selector(f"#requests td:text-is('{gen_id}')")
    assert "succeeded" in row.evaluate("td => td.parentElement.textContent")
    row.click()
    page.wait_for_selector("#request-detail:not([hidden]) #detail-dag g.node")
    assert page.text_content("#detail-id") == gen_id
    page.screenshot(path=str(ARTIFACTS / "console-operator.png"), full_page=True)
    assert not [e for e in page.errors if "404" not in e], page.errors  # type: ignore[attr-defined]


def test_an_edit_from_the_playground_uploads_the_image_and_mask(stack, page, tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(tmp_path / "in.png")
    Image.new("RGBA", (32, 32), (0, 0, 0, 0)).save(tmp_path / "mask.png")
    posted: list[str] = []
    page.on("request", lambda r: posted.append(r.url) if r.method == "POST" else None)
    page.goto(stack.url + "/console")
    use_key(page, "sk-alice")
    page.wait_for_selector("#workflow option[value='console-edit']", state="attached")
    page.select_option("#workflow", "console-wf")
    assert page.is_hidden("#edit-image")  # a workflow that takes no image: no upload shown
    page.select_option("#workflow", "console-edit")
    page.wait_for_selector("#edit-image", state="visible")
    page.set_input_files("#edit-image", str(tmp_path / "in.png"))
    page.set_input_files("#edit-mask", str(tmp_path / "mask.png"))
    page.fill("#strength", "0.5")
    page.fill("#prompt", "a hat")
    page.click("#generate")
    page.wait_for_selector(
        ",".join(f"#status[data-status={s}]" for s in ("succeeded", "failed", "cancelled"))
    )
    assert page.text_content("#status") == "succeeded", page.text_content("#error")
    assert page.eval_on_selector("#images img", "img => img.complete && img.naturalWidth") > 0
    assert any(u.endswith("/v1/images/edits") for u in posted), posted
    assert not page.errors, page.errors  # type: ignore[attr-defined]


def test_cancel_from_the_playground_stops_the_call(stack, page):
    page.goto(stack.url + "/console")
    use_key(page, "sk-alice")
    page.wait_for_selector("#workflow option[value='console-wf']", state="attached")
    page.select_option("#workflow", "console-wf")
    page.fill("#prompt", "a long one")
    page.fill("#steps", "60")  # 15 s of denoising: cancelled long before it ends
    page.click("#generate")
    page.wait_for_selector("#gen-dag g.node.done")
    page.click("#cancel")
    page.wait_for_selector(
        ",".join(f"#status[data-status={s}]" for s in ("succeeded", "failed", "cancelled"))
    )
    assert page.text_content("#status") == "cancelled"
    assert "cancelled" in page.text_content("#error")
    assert page.query_selector_all("#gen-dag g.node.pending")  # the rest never ran
    assert not page.query_selector("#images img")
    assert not page.errors, page.errors  # type: ignore[attr-defined]


def test_the_page_draws_the_dag_the_gateway_unrolls_as_the_scheduler_does(stack, page):
    """The boxes the page draws are the gateway's unrolling of the workflow (GET
    /v1/workflows/{name}/dag: libs/workflow/dag.py, the scheduler's), not a second one in the page:
    their ids are the ones the scheduler's events carry."""
    from libs.workflow.dag import unroll

    spec = sim_workflow("console-wf", "console", steps=STEPS)
    page.goto(stack.url + "/console")
    page.wait_for_selector("#gen-form")
    page.evaluate(
        "k => { T2IDag.setFetcher((p) => fetch(p, {headers: {Authorization: `Bearer ${k}`}}).then(async r => ({status: r.status, data: await r.json()}))); }",
        "sk-alice",
    )
    for steps in (2, 5):
        params = {n: p.default for n, p in spec.params.items()} | {"num_inference_steps": steps}
        want = [(n.id, sorted(n.deps | n.cb_deps)) for n in unroll(spec, params).nodes.values()]
        got = page.evaluate(
            "c => T2IDag.fetchNodes('console-wf', c).then(ns => ns.map(n => [n.id, [...n.deps].sort()]))",
            {"num_inference_steps": steps},
        )
        assert [tuple(x) for x in got] == want
    # What the route refuses: a parameter the workflow lacks, a loop too long to draw, bad JSON.
    status, _, body = call(
        stack, "GET", "/v1/workflows/console-wf/dag?params=%7B%22nope%22%3A1%7D", "sk-alice"
    )
    assert status == 422 and b"params.nope" in body
    status, _, body = call(
        stack,
        "GET",
        "/v1/workflows/console-wf/dag?params=%7B%22num_inference_steps%22%3A100000%7D",
        "sk-alice",
    )
    assert status == 422, body
    assert call(stack, "GET", "/v1/workflows/console-wf/dag?params=%5B", "sk-alice")[0] == 422
    assert call(stack, "GET", "/v1/workflows/nowhere/dag", "sk-alice")[0] == 404
    # A request's loop count, from its node events when the page did not submit it.
    events = [{"type": "node", "node_id": "dit@2", "steps": 6, "done": 5, "total": 9}]
    counts = page.evaluate(
        "([s, e]) => T2IDag.loopCounts(s, e, null)", [json.loads(encode_spec(spec)), events]
    )
    assert counts == {"num_inference_steps": 6}
