// The console: a playground (submit with `Prefer: respond-async`, follow /v1/requests/{id}/events)
// and an operator view (tenants, executors, recent requests). Every call carries the API key typed
// into the page (kept in localStorage); the page itself is public and holds no secret.
// Server-sent events are read with fetch() and a stream reader: EventSource cannot send the
// Authorization header.
"use strict";

(function () {
  const KEY_STORE = "t2i.apiKey";
  const $ = (id) => document.getElementById(id);
  const state = { key: "", workflows: [], specs: {}, run: null, opTimer: null, detail: null };

  // -- HTTP --------------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, body) {
      const msg = body && body.error && body.error.message ? body.error.message : `HTTP ${status}`;
      super(msg);
      this.status = status;
      this.body = body;
    }
  }

  async function api(method, path, body, headers) {
    const h = Object.assign({ Authorization: `Bearer ${state.key}` }, headers || {});
    const init = { method, headers: h };
    if (body !== undefined) {
      h["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    const text = await resp.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch (e) {
      data = { error: { message: text.slice(0, 300) } };
    }
    if (!resp.ok) throw new ApiError(resp.status, data);
    return { status: resp.status, data, headers: resp.headers };
  }
  // A multipart form call (an edit): the browser sets the Content-Type with its boundary.
  async function apiForm(path, form, headers) {
    const h = Object.assign({ Authorization: `Bearer ${state.key}` }, headers || {});
    const resp = await fetch(path, { method: "POST", headers: h, body: form });
    const text = await resp.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch (e) {
      data = { error: { message: text.slice(0, 300) } };
    }
    if (!resp.ok) throw new ApiError(resp.status, data);
    return { status: resp.status, data, headers: resp.headers };
  }
  window.T2IDag.setFetcher((path) => api("GET", path));

  // Reads a text/event-stream response body, calling onEvent({id, event, data}) per event.
  async function readEvents(resp, onEvent, signal) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      if (signal && signal.aborted) break;
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const ev = { id: null, event: "message", data: "" };
        const data = [];
        for (const line of block.split("\n")) {
          if (!line || line.startsWith(":")) continue; // a comment: the heartbeat
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "id") ev.id = val;
          else if (field === "event") ev.event = val;
          else if (field === "data") data.push(val);
        }
        if (!data.length) continue;
        ev.data = data.join("\n");
        onEvent(ev);
      }
    }
  }

  // Follows a call's events until `done`, resuming with Last-Event-ID if the stream drops.
  async function follow(id, onNode, signal) {
    let lastId = null;
    for (let attempt = 0; attempt < 5; attempt++) {
      const headers = { Authorization: `Bearer ${state.key}`, Accept: "text/event-stream" };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const resp = await fetch(`/v1/requests/${encodeURIComponent(id)}/events`, { headers, signal });
      if (!resp.ok) {
        let body = null;
        try { body = await resp.json(); } catch (e) { /* not JSON */ }
        throw new ApiError(resp.status, body);
      }
      let final = null;
      await readEvents(resp, (ev) => {
        if (ev.id) lastId = ev.id;
        let data;
        try { data = JSON.parse(ev.data); } catch (e) { return; }
        if (ev.event === "node") onNode(data);
        else if (ev.event === "done") final = data;
      }, signal);
      if (final) return final;
      if (signal && signal.aborted) return null;
      await new Promise((r) => setTimeout(r, 500 * (attempt + 1)));
    }
    const { data } = await api("GET", `/v1/requests/${encodeURIComponent(id)}`);
    return data;
  }

  // -- helpers -----------------------------------------------------------------------------------
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function table(host, columns, rows, onRow) {
    host.replaceChildren();
    if (!rows.length) {
      host.appendChild(el("p", { class: "muted" }, "none"));
      return;
    }
    const t = el("table");
    const tr = el("tr");
    for (const c of columns) tr.appendChild(el("th", {}, c.title));
    t.appendChild(el("thead")).appendChild(tr);
    const body = t.appendChild(el("tbody"));
    for (const row of rows) {
      const r = el("tr");
      for (const c of columns) {
        const v = c.value(row);
        const td = el("td", c.num ? { class: "num" } : {});
        if (v instanceof Node) td.appendChild(v);
        else td.textContent = v === undefined || v === null ? "" : String(v);
        r.appendChild(td);
      }
      if (onRow) {
        r.classList.add("clickable");
        r.addEventListener("click", () => onRow(row, r));
      }
      body.appendChild(r);
    }
    host.appendChild(t);
  }

  function problem(host, err) {
    host.replaceChildren(el("p", { class: "error" }, err.status === 403 ? "needs an admin API key" : err.message));
  }

  const num = (x, d = 3) => (typeof x === "number" ? x.toFixed(d) : "");
  const when = (unix) => (unix ? new Date(unix * 1000).toLocaleTimeString() : "");
  const gpu = (status) => (status && status.usage ? num(status.usage.gpu_seconds, 3) : "");

  async function spec(name) {
    if (!state.specs[name]) {
      try {
        const { data } = await api("GET", `/v1/workflows/${encodeURIComponent(name)}`);
        state.specs[name] = data.workflow;
      } catch (e) {
        return null;
      }
    }
    return state.specs[name];
  }

  // -- key -------------------------------------------------------------------------------------------
  async function useKey(key) {
    state.key = key.trim();
    localStorage.setItem(KEY_STORE, state.key);
    $("key-state").textContent = "";
    if (!state.key) return;
    try {
      await loadWorkflows();
      $("key-state").textContent = "✓";
      if (!$("operator").hidden) refreshOperator();
    } catch (e) {
      $("key-state").textContent = e.message;
    }
  }

  // -- playground ----------------------------------------------------------------------------------
  async function loadWorkflows() {
    const { data } = await api("GET", "/v1/workflows");
    state.workflows = data.data || [];
    const sel = $("workflow");
    const current = sel.value;
    sel.replaceChildren(...state.workflows.map((w) => el("option", { value: w.name }, `${w.name} (v${w.version})`)));
    if (state.workflows.some((w) => w.name === current)) sel.value = current;
    pickWorkflow();
  }

  function pickWorkflow() {
    const wf = state.workflows.find((w) => w.name === $("workflow").value);
    $("workflow-desc").textContent = wf ? wf.description || "" : "no workflows registered";
    const params = new Set(wf ? wf.params : []);
    for (const label of document.querySelectorAll("[data-param]")) label.hidden = !params.has(label.dataset.param);
    const sizes = wf && wf.sizes && wf.sizes.length ? ["auto", ...wf.sizes] : ["auto"];
    $("size").replaceChildren(...sizes.map((s) => el("option", { value: s }, s)));
    if (wf) spec(wf.name).then((s) => {
      const steps = s && s.params && s.params.num_inference_steps;
      if (steps && steps.default && !$("steps").value) $("steps").placeholder = String(steps.default);
    });
  }

  function request() {
    const wf = state.workflows.find((w) => w.name === $("workflow").value);
    if (!wf) throw new Error("pick a workflow");
    const params = new Set(wf.params);
    const body = { model: wf.name, prompt: $("prompt").value, n: Number($("n").value || 1) };
    if ($("size").value !== "auto") body.size = $("size").value;
    if ($("format").value !== "png") body.output_format = $("format").value;
    const ints = { num_inference_steps: "steps", seed: "seed" };
    for (const [name, id] of Object.entries(ints)) {
      const v = $(id).value;
      if (params.has(name) && v !== "") body[name] = Number.parseInt(v, 10);
    }
    if (params.has("guidance_scale") && $("guidance").value !== "") body.guidance_scale = Number($("guidance").value);
    if (params.has("strength") && $("strength").value !== "") body.strength = Number($("strength").value);
    const extra = $("extra").value.trim();
    if (extra) {
      let parsed;
      try { parsed = JSON.parse(extra); } catch (e) { throw new Error(`other parameters: not JSON (${e.message})`); }
      if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("other parameters: must be a JSON object");
      body.params = parsed;
    }
    return body;
  }

  function setStatus(status) {
    $("status").textContent = status;
    $("status").dataset.status = status;
  }

  function showProgress(run) {
    const steps = {}, nodes = {};
    for (const e of run.events) {
      steps[e.image ?? 0] = [e.step || 0, e.steps || 0];
      nodes[e.image ?? 0] = [e.done || 0, e.total || 0];
    }
    const sum = (m, i) => Object.values(m).reduce((s, v) => s + v[i], 0);
    const [st, sts, nd, nt] = [sum(steps, 0), sum(steps, 1), sum(nodes, 0), sum(nodes, 1)];
    $("step-text").textContent = `${st} / ${sts}`;
    $("step-bar").max = Math.max(sts, 1);
    $("step-bar").value = st;
    $("node-text").textContent = `${nd} / ${nt}`;
    $("node-bar").max = Math.max(nt, 1);
    $("node-bar").value = nd;
    if (run.spec !== undefined) window.T2IDag.show($("gen-dag"), $("gen-timings"), run.spec, run.events, run.n, run.params);
  }

  function showImages(final, format) {
    const host = $("images");
    host.replaceChildren();
    for (const [i, item] of (final.data || []).entries()) {
      const img = el("img", { alt: `image ${i + 1}`, "data-index": String(i) });
      if (item.b64_json) img.src = `data:image/${format === "jpeg" ? "jpeg" : format};base64,${item.b64_json}`;
      else if (item.url) loadUrl(img, item.url);
      const fig = el("figure");
      fig.appendChild(img);
      if (item.revised_prompt) fig.appendChild(el("figcaption", {}, item.revised_prompt));
      host.appendChild(fig);
    }
  }

  async function loadUrl(img, url) {
    // File URLs need the key too; same-origin ones only (the page's CSP allows no other).
    const resp = await fetch(url, { headers: { Authorization: `Bearer ${state.key}` } });
    if (resp.ok) img.src = URL.createObjectURL(await resp.blob());
  }

  function showFinal(final) {
    setStatus(final.status);
    const u = final.usage || {};
    $("usage").textContent = typeof u.gpu_seconds === "number" ? `GPU time ${u.gpu_seconds.toFixed(3)} s` : "";
    if (final.error) {
      $("error").hidden = false;
      $("error").textContent = `${final.error.code || "error"}: ${final.error.message || ""}`;
    }
  }

  // A generation, or an edit when the workflow takes an image and one was picked (its file, and
  // the mask's, fill the workflow's image and mask parameters: POST /v1/images/edits).
  function submit(body) {
    const wf = state.workflows.find((w) => w.name === body.model);
    const picture = $("edit-image").files[0];
    if (!wf || !wf.params.includes("image") || !picture) {
      return api("POST", "/v1/images/generations", body, { Prefer: "respond-async" });
    }
    const form = new FormData();
    for (const [k, v] of Object.entries(body)) form.append(k, typeof v === "object" ? JSON.stringify(v) : String(v));
    form.append("image", picture, picture.name);
    const mask = $("edit-mask").files[0];
    if (mask && wf.params.includes("mask")) form.append("mask", mask, mask.name);
    return apiForm("/v1/images/edits", form, { Prefer: "respond-async" });
  }

  async function generate(ev) {
    ev.preventDefault();
    if (state.run && state.run.abort) state.run.abort.abort();
    $("error").hidden = true;
    $("images").replaceChildren();
    $("usage").textContent = "";
    let body;
    try {
      body = request();
    } catch (e) {
      $("error").hidden = false;
      $("error").textContent = e.message;
      return;
    }
    const run = { id: null, events: [], n: body.n, params: body, abort: new AbortController(), spec: undefined };
    state.run = run;
    $("generate").disabled = true;
    setStatus("submitting");
    try {
      const { data } = await submit(body);
      run.id = data.id;
      $("gen-id").textContent = data.id;
      $("cancel").disabled = false;
      setStatus(data.status);
      run.spec = await spec(body.model);
      showProgress(run);
      const final = await follow(data.id, (node) => {
        run.events.push(node);
        setStatus("running");
        showProgress(run);
      }, run.abort.signal);
      if (final) {
        showFinal(final);
        showImages(final, body.output_format || "png");
      }
    } catch (e) {
      if (e.name !== "AbortError") {
        setStatus("failed");
        $("error").hidden = false;
        $("error").textContent = e.message;
      }
    } finally {
      $("generate").disabled = false;
      $("cancel").disabled = true;
    }
  }

  async function cancel() {
    const run = state.run;
    if (!run || !run.id) return;
    $("cancel").disabled = true;
    try {
      const { data } = await api("POST", `/v1/requests/${encodeURIComponent(run.id)}/cancel`);
      showFinal(data);
    } catch (e) {
      $("error").hidden = false;
      $("error").textContent = e.message;
    }
  }

  // -- operator view -------------------------------------------------------------------------------
  async function refreshOperator() {
    if (!state.key) return;
    await Promise.all([tenants(), executors(), requests()]);
    $("op-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  }

  async function tenants() {
    try {
      const { data } = await api("GET", "/v1/admin/tenants");
      table($("tenants"), [
        { title: "tenant", value: (t) => t.tenant },
        { title: "vTime (s)", value: (t) => num(t.vtime_s), num: true },
        { title: "service (s)", value: (t) => num(t.service_s), num: true },
        { title: "queued", value: (t) => t.queued ?? 0, num: true },
        { title: "ready nodes", value: (t) => t.ready_nodes ?? 0, num: true },
        { title: "running nodes", value: (t) => t.running_nodes ?? 0, num: true },
        { title: "in progress", value: (t) => t.requests ?? "", num: true },
      ], data.data || []);
    } catch (e) {
      problem($("tenants"), e);
    }
  }

  function busyBar(x) {
    const p = el("progress", { max: "1", title: `${Math.round(100 * (x || 0))}% busy` });
    p.value = x || 0;
    return p;
  }

  // Resident models are "fn|model" keys: one chip per model, the ModelFns using it in its title.
  function chips(keys) {
    const box = el("div", { class: "chips" });
    const seen = new Map();
    for (const key of keys || []) {
      const cut = String(key).lastIndexOf("|");
      const name = cut >= 0 ? String(key).slice(cut + 1) : String(key);
      seen.set(name, [...(seen.get(name) || []), String(key)]);
    }
    for (const [name, full] of seen) box.appendChild(el("span", { class: "chip", title: full.join("\n") }, name));
    return box;
  }

  async function executors() {
    try {
      const { data } = await api("GET", "/v1/admin/executors");
      const now = Date.now() / 1000;
      table($("executors"), [
        { title: "executor", value: (x) => x.id },
        { title: "kind", value: (x) => x.kind },
        { title: "busy", value: (x) => busyBar(x.busy) },
        { title: "running", value: (x) => x.running ?? 0, num: true },
        { title: "GPU-resident models", value: (x) => chips(x.resident) },
        { title: "host-cached models", value: (x) => chips(x.host_resident) },
        { title: "ModelFns", value: (x) => el("span", { title: (x.fns || []).join("\n"), class: "hint" }, (x.fns || []).length), num: true },
        { title: "seen", value: (x) => (x.seen ? `${Math.max(0, now - x.seen).toFixed(0)} s ago` : "") },
      ], data.data || []);
    } catch (e) {
      problem($("executors"), e);
    }
  }

  async function requests() {
    let rows;
    try {
      rows = (await api("GET", "/v1/requests?tenant=*&limit=20")).data.data;
    } catch (e) {
      if (e.status !== 403) return problem($("requests"), e);
      try {
        rows = (await api("GET", "/v1/requests?limit=20")).data.data; // a tenant key: its own calls
      } catch (e2) {
        return problem($("requests"), e2);
      }
    }
    table($("requests"), [
      { title: "id", value: (r) => r.id },
      { title: "tenant", value: (r) => r.tenant || "(you)" },
      { title: "workflow", value: (r) => r.model },
      { title: "status", value: (r) => el("span", { class: `status ${r.status}` }, r.status) },
      { title: "images", value: (r) => `${r.completed}/${r.n}`, num: true },
      { title: "nodes", value: (r) => (r.progress ? `${r.progress.nodes_done}/${r.progress.nodes_total}` : ""), num: true },
      { title: "GPU s", value: gpu, num: true },
      { title: "created", value: (r) => when(r.created) },
    ], rows || [], (r) => detail(r));
  }

  async function detail(rec) {
    if (state.detail && state.detail.abort) state.detail.abort.abort();
    const d = { abort: new AbortController(), events: [] };
    state.detail = d;
    $("request-detail").hidden = false;
    $("detail-id").textContent = rec.id;
    $("detail-summary").textContent = `${rec.model} · ${rec.status} · ${rec.n} image(s) · GPU ${gpu(rec) || "?"} s`;
    const s = await spec(rec.model);
    const draw = () => window.T2IDag.show($("detail-dag"), $("detail-timings"), s, d.events, rec.n, null);
    draw();
    try {
      const final = await follow(rec.id, (node) => { d.events.push(node); draw(); }, d.abort.signal);
      if (final) $("detail-summary").textContent = `${final.model} · ${final.status} · ${final.n} image(s) · GPU ${gpu(final) || "?"} s`;
    } catch (e) {
      if (e.name === "AbortError") return;
      const why = e.status === 404 ? "its events are visible to the tenant that made it (use its key)" : e.message;
      $("detail-timings").replaceChildren(el("p", { class: "error" }, why));
    }
  }

  function showTab(name) {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.tab === name);
    $("playground").hidden = name !== "playground";
    $("operator").hidden = name !== "operator";
    clearInterval(state.opTimer);
    state.opTimer = null;
    if (name === "operator") {
      refreshOperator();
      if ($("auto-refresh").checked) state.opTimer = setInterval(refreshOperator, 2000);
    }
  }

  // -- start -----------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", (e) => { e.preventDefault(); useKey($("api-key").value); });
    $("workflow").addEventListener("change", pickWorkflow);
    $("gen-form").addEventListener("submit", generate);
    $("cancel").addEventListener("click", cancel);
    $("refresh").addEventListener("click", refreshOperator);
    $("auto-refresh").addEventListener("change", () => showTab("operator"));
    for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => showTab(t.dataset.tab));
    const saved = localStorage.getItem(KEY_STORE) || "";
    $("api-key").value = saved;
    if (saved) useKey(saved);
  });
})();
