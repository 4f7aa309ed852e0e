// A request's DAG and node timings, drawn from the gateway's unrolling of its workflow and its node
// events: the nodes come from GET /v1/workflows/{name}/dag (the scheduler's unrolling, node ids
// "dit@3", nested loops "x@1.2"), so the ids the scheduler puts in its events name the boxes drawn
// here; nothing is unrolled twice. Everything is built with DOM calls
// and textContent: event fields come from the server and are never parsed as HTML.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const MAX_NODES = 600; // beyond this the drawing is not readable anyway: the table still is
  const BOX_W = 118, BOX_H = 38, GAP_X = 34, GAP_Y = 14;

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  // Loop counts for a request: the params given, else the parameter's default, else 1 — or, for a
  // top-level loop, the iterations its events show where those are more or the request ended.
  function loopCounts(spec, events, params) {
    const counts = {};
    const seen = {};
    for (const ev of events || []) {
      const m = /^([^@]+)@(\d+)/.exec(ev.node_id || "");
      if (m) seen[m[1]] = Math.max(seen[m[1]] || 0, Number(m[2]) + 1);
    }
    const ended = (events || []).some((e) => e.type === "node" && e.total && e.done === e.total);
    // The events' `steps` (denoising steps in total) is the count when one loop is all there is.
    const loops = [];
    (function find(ops) {
      for (const op of ops || []) if (op.type === "loop") loops.push(op) && find(op.body);
    })(spec.body);
    const steps = Math.max(0, ...(events || []).map((e) => e.steps || 0));
    function walk(ops, top) {
      for (const op of ops || []) {
        if (op.type !== "loop") continue;
        if (typeof op.count !== "number") {
          const name = String(op.count).replace(/^param:/, "");
          const given = params && Number.isInteger(params[name]) ? params[name] : null;
          const dflt = spec.params && spec.params[name] ? spec.params[name].default : null;
          let count = given || (loops.length === 1 && steps) || dflt || 1;
          const shown = top ? Math.max(0, ...(op.body || []).map((b) => seen[b.id] || 0)) : 0;
          if (shown && (ended || shown > count)) count = shown;
          counts[name] = count;
        }
        walk(op.body, false);
      }
    }
    walk(spec.body, true);
    return counts;
  }

  // The unrolled nodes of a workflow for loop counts `counts`, as the gateway serves them
  // (GET /v1/workflows/{name}/dag: the scheduler's own unrolling, libs/workflow/dag.py), so the ids
  // drawn are the ones the node events carry. Fetched once per (workflow, counts); `redraw` runs
  // when they arrive. null until then (or if the gateway has none): the caller draws from events.
  let fetcher = null; // set by the page: path -> Promise<{status, data}>
  const dags = new Map(); // "name?counts" -> [{id, fn, model, deps}] | "pending" | "failed"

  function setFetcher(fn) {
    fetcher = fn;
  }

  function dagPath(name, counts) {
    return `/v1/workflows/${encodeURIComponent(name)}/dag?params=${encodeURIComponent(JSON.stringify(counts))}`;
  }

  function fetchNodes(name, counts) {
    return fetcher(dagPath(name, counts)).then((r) => {
      if (r.status !== 200 || !r.data || !Array.isArray(r.data.nodes)) throw new Error(`dag: ${r.status}`);
      return r.data.nodes.map((n) => ({
        id: String(n.id), fn: String(n.fn), model: String(n.model || ""),
        deps: [...(n.deps || []), ...(n.callbacks || [])].map(String),
      }));
    });
  }

  function served(spec, counts, redraw) {
    const key = `${spec.name}?${JSON.stringify(counts)}`;
    const got = dags.get(key);
    if (Array.isArray(got)) return got;
    if (got === undefined && fetcher && spec.name) {
      dags.set(key, "pending");
      fetchNodes(spec.name, counts).then(
        (nodes) => { dags.set(key, nodes.slice(0, MAX_NODES + 1)); redraw(); },
        () => dags.set(key, "failed"),
      );
    }
    return null;
  }

  // Without a spec (or when its ids do not match the events): the nodes the events name, in order.
  function fromEvents(events) {
    const nodes = [];
    const seen = new Set();
    for (const ev of events) {
      if (ev.type !== "node" || seen.has(ev.node_id)) continue;
      seen.add(ev.node_id);
      nodes.push({ id: ev.node_id, fn: ev.fn || "", model: ev.model || "", deps: [] });
    }
    return nodes;
  }

  function eventsByNode(events) {
    const by = {};
    for (const ev of events || []) {
      if (ev.type !== "node") continue;
      (by[ev.node_id] = by[ev.node_id] || []).push(ev);
    }
    return by;
  }

  function seconds(x) {
    return typeof x === "number" && isFinite(x) ? x : 0;
  }

  function fmt(x) {
    const s = seconds(x);
    return s >= 1 ? s.toFixed(2) + " s" : (s * 1000).toFixed(1) + " ms";
  }

  // Draw the DAG into `host`. `images` is how many images the request has: a node is "done" once
  // it finished for every image, "partial" once for some.
  function render(host, nodes, events, images) {
    host.replaceChildren();
    if (!nodes.length) {
      host.appendChild(el("p", { class: "muted" }, "no nodes yet"));
      return;
    }
    const by = eventsByNode(events);
    const level = {};
    const index = {};
    nodes.forEach((n, i) => (index[n.id] = i));
    for (const n of nodes) level[n.id] = Math.max(0, ...n.deps.map((d) => (d in level ? level[d] + 1 : 0)));
    const rows = {};
    const pos = {};
    for (const n of nodes) {
      const l = level[n.id];
      rows[l] = (rows[l] || 0) + 1;
      pos[n.id] = { x: 8 + l * (BOX_W + GAP_X), y: 8 + (rows[l] - 1) * (BOX_H + GAP_Y) };
    }
    const width = 16 + (Math.max(...Object.values(level)) + 1) * (BOX_W + GAP_X);
    const height = 16 + Math.max(...Object.values(rows)) * (BOX_H + GAP_Y);
    const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    root.appendChild(svg("title")).textContent = `DAG: ${nodes.length} nodes`;
    for (const n of nodes) {
      for (const d of n.deps) {
        if (!(d in pos)) continue;
        const a = pos[d], b = pos[n.id];
        const x1 = a.x + BOX_W, y1 = a.y + BOX_H / 2, x2 = b.x, y2 = b.y + BOX_H / 2;
        const mx = (x1 + x2) / 2;
        root.appendChild(svg("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, class: "edge" }));
      }
    }
    for (const n of nodes) {
      const evs = by[n.id] || [];
      const state = evs.length === 0 ? "pending" : evs.length >= (images || 1) ? "done" : "partial";
      const g = svg("g", { class: `node ${state}`, "data-node": n.id, transform: `translate(${pos[n.id].x},${pos[n.id].y})` });
      g.appendChild(svg("rect", { width: BOX_W, height: BOX_H, rx: 6 }));
      const label = svg("text", { x: 8, y: 16 });
      label.textContent = n.id.length > 16 ? n.id.slice(0, 15) + "…" : n.id;
      const sub = svg("text", { x: 8, y: 31, class: "sub" });
      const ev = evs[evs.length - 1];
      const model = n.model.length > 17 ? n.model.slice(0, 16) + "…" : n.model;
      sub.textContent = ev && ev.timing ? fmt(seconds(ev.timing.exec_s)) : model;
      const tip = svg("title");
      const lines = [`${n.id}  ${n.fn}`, n.model && `model ${n.model}`];
      if (ev) {
        const t = ev.timing || {};
        lines.push(`executor ${ev.executor || "?"}`);
        lines.push(`load ${fmt(t.load_s)} (${t.load_tier || "-"}), fetch ${fmt(t.fetch_s)}, exec ${fmt(t.exec_s)}, store ${fmt(t.store_s)}`);
      }
      tip.textContent = lines.filter(Boolean).join("\n");
      g.append(tip, label, sub);
      root.appendChild(g);
    }
    host.appendChild(root);
  }

  // The node events as a table with a timeline: each bar spans the node's load, fetch, exec and
  // store, ending at the event's time `t` (when the scheduler accepted the node's completion).
  function timings(host, events) {
    host.replaceChildren();
    const rows = (events || []).filter((e) => e.type === "node");
    if (!rows.length) {
      host.appendChild(el("p", { class: "muted" }, "no node has finished yet"));
      return;
    }
    const total = (e) => ["load_s", "fetch_s", "exec_s", "store_s"].reduce((s, k) => s + seconds((e.timing || {})[k]), 0);
    const start = Math.min(...rows.map((e) => seconds(e.t) - total(e)));
    const end = Math.max(...rows.map((e) => seconds(e.t)));
    const span = Math.max(end - start, 1e-6);
    const table = el("table", { class: "timings" });
    const head = el("tr");
    for (const h of ["image", "node", "fn", "model", "executor", "tier", "load", "fetch", "exec", "store", "timeline"]) head.appendChild(el("th", {}, h));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const e of rows) {
      const t = e.timing || {};
      const tr = el("tr", { "data-node": e.node_id });
      for (const v of [e.image ?? 0, e.node_id, e.fn, e.model, e.executor, t.load_tier || "-"]) tr.appendChild(el("td", {}, v ?? ""));
      for (const k of ["load_s", "fetch_s", "exec_s", "store_s"]) tr.appendChild(el("td", { class: "num" }, fmt(t[k])));
      const cell = el("td", { class: "timeline" });
      const lane = cell.appendChild(el("div", { class: "lane" }));
      let at = seconds(e.t) - total(e);
      for (const k of ["load_s", "fetch_s", "exec_s", "store_s"]) {
        const w = seconds(t[k]);
        const seg = el("div", { class: `seg ${k.replace("_s", "")}`, title: `${k.replace("_s", "")} ${fmt(w)}` });
        seg.style.left = `${(100 * (at - start)) / span}%`;
        seg.style.width = `max(1px, ${(100 * w) / span}%)`;
        lane.appendChild(seg);
        at += w;
      }
      tr.appendChild(cell);
      body.appendChild(tr);
    }
    host.appendChild(table);
    const legend = el("p", { class: "muted legend" }, `timeline over ${fmt(span)}:`);
    for (const k of ["load", "fetch", "exec", "store"]) {
      legend.appendChild(el("span", { class: `key seg-${k}` }));
      legend.appendChild(document.createTextNode(k));
    }
    host.appendChild(legend);
  }

  // Draw `events` over `spec` (either may be missing) into the DAG and timing hosts.
  function show(dagHost, timingHost, spec, events, images, params) {
    let nodes = null;
    if (spec) {
      const redraw = () => show(dagHost, timingHost, spec, events, images, params);
      nodes = served(spec, loopCounts(spec, events, params), redraw);
      const ids = new Set((nodes || []).map((n) => n.id));
      if (nodes && (events || []).some((e) => e.type === "node" && !ids.has(e.node_id))) nodes = null;
    }
    if (!nodes) nodes = fromEvents(events || []);
    render(dagHost, nodes, events, images);
    timings(timingHost, events);
  }

  window.T2IDag = { setFetcher, fetchNodes, loopCounts, render, timings, show };
})();
