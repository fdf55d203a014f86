// tokenfleet's dashboard: polls /dashboard/api and draws it (charts.js the charts, requests.js the
// requests tab). No framework, no CDN: these files ship in the package. Every value from the server
// goes into the page as text, never HTML.
"use strict";

const POLL_MS = 2000;
const $ = (sel) => document.querySelector(sel);
const state = { key: null, fleet: null, canAct: false, tab: "overview", following: null };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function headers() {
  return state.key ? { Authorization: "Bearer " + state.key } : {};
}

async function api(path, method = "GET") {
  const sep = path.includes("?") ? "&" : "?";
  const url = "/dashboard/api" + path + (state.fleet ? sep + "fleet=" + encodeURIComponent(state.fleet) : "");
  const response = await fetch(url, { method, headers: headers() });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new Error((body.error && body.error.message) || response.statusText);
    error.status = response.status;
    throw error;
  }
  return body;
}

const ago = (seconds) => (seconds === null || seconds === undefined ? "-" : seconds < 90 ? seconds.toFixed(1) + " s" : seconds < 5400 ? (seconds / 60).toFixed(1) + " min" : (seconds / 3600).toFixed(1) + " h");
const when = (unix) => (unix ? new Date(unix * 1000).toLocaleTimeString() : "-");
const fill = (table, rows) => $(table + " tbody").replaceChildren(...rows);

// -- sign in ---------------------------------------------------------------------------------

async function signIn() {
  // the overview is asked for beside the key check, not after it: one round trip less to the first view
  const first = state.tab === "overview" ? api("/overview").catch(() => null) : Promise.resolve(null);
  try {
    const me = await api("/whoami");
    state.canAct = me.can_act;
    const pick = $("#fleet");
    pick.replaceChildren(...me.fleets.map((f) => el("option", { value: f }, f)));
    state.fleet = state.fleet || me.fleets[0];
    pick.value = state.fleet;
    $("#fleet-pick").hidden = me.fleets.length < 2;
    $("#who").textContent = (me.can_act ? "admin" : "viewer") + " · " + me.who;
    document.body.classList.toggle("viewer", !me.can_act);
    $("#login").hidden = true;
    $("#app").hidden = false;
    const overview = await first;
    if (overview && overview.prefix === state.fleet) drawOverview(overview);
    else refresh();
  } catch (e) {
    $("#app").hidden = true;
    $("#login").hidden = false;
    $("#login-error").textContent = e.status === 401 && state.key ? "that key is not accepted" : e.status === 401 ? "" : e.message;
  }
}

// -- overview --------------------------------------------------------------------------------

function workerRow(w) {
  const kv = w.kv_blocks_total ? w.kv_blocks_used / w.kv_blocks_total : 0;
  const queries = w.prefix_cache_queries || 0;
  const hits = queries ? Math.round((100 * (w.prefix_cache_hits || 0)) / queries) + "%" : "-";
  return el("tr", { class: w.alive ? "alive" : "stale", "data-worker": w.name },
    el("td", {}, w.name),
    el("td", { class: "state" }, w.alive ? "alive" : "stale"),
    el("td", {}, ago(w.seen_s_ago) + " ago"),
    el("td", {}, w.model || "-"),
    el("td", {}, w.engine || "native"),
    el("td", {}, (w.device || "?") + (w.dtype ? " " + w.dtype : "")),
    el("td", {}, (w.buckets || []).join(", ")),
    el("td", {}, w.shards_owned ?? "-"),
    el("td", { class: "num" }, w.running ?? 0),
    el("td", { class: "num", title: "read, not started, per lane" },
      w.lanes ? Object.entries(w.lanes).map(([lane, n]) => `${lane} ${n}`).join(" · ") : w.waiting ?? 0),
    el("td", {}, el("span", { class: "bar", title: `${w.kv_blocks_used}/${w.kv_blocks_total} blocks` },
      el("span", { style: `width:${Math.round(kv * 100)}%` })), ` ${Math.round(kv * 100)}%`),
    el("td", { class: "num" }, w.tokens_per_s ?? 0),
    el("td", { class: "num" }, w.finished ?? 0),
    el("td", { class: "num" }, hits),
    el("td", {}, (w.adapters || []).join(", ") || "-"));
}

function queueRow(q) {
  const shards = q.shards.map((s) => `${s.stream.split(":req:")[1]}: ${s.waiting} waiting, ${s.pending} pending`);
  return el("tr", { class: q.waiting || q.pending ? "busy" : "empty", "data-queue": q.name },
    el("td", {}, q.name), el("td", {}, q.bucket), el("td", {}, q.lane),
    el("td", { class: "num waiting" }, q.waiting), el("td", { class: "num pending" }, q.pending),
    el("td", { class: "num" }, ago(q.oldest_waiting_s)), el("td", { class: "num" }, q.entries),
    el("td", { class: "quiet", title: shards.join("\n") }, shards.length ? `${shards.length} stream(s)` : "-"));
}

async function refreshOverview() {
  drawOverview(await api("/overview"));
}

function drawOverview(o) {
  const warnings = [];
  if (o.redis.evicting) warnings.push(`Redis's maxmemory-policy is ${o.redis.maxmemory_policy}: it may delete queued requests (set noeviction)`);
  if (o.redis.out_of_memory) warnings.push("Redis is out of memory: submits are refused and workers cannot heartbeat");
  $("#warnings").textContent = warnings.join(" · ");
  fill("#workers", o.workers.map(workerRow));
  $("#worker-count").textContent = `${o.workers.filter((w) => w.alive).length} alive / ${o.workers.length}`;
  const showEmpty = $("#show-empty").checked;
  const shown = o.queues.filter((q) => showEmpty || q.waiting || q.pending || q.entries);
  fill("#queues", shown.length ? shown.map(queueRow) : [el("tr", {}, el("td", { colspan: 8, class: "quiet" }, "every queue is empty"))]);
  $("#dead-count").textContent = o.dead_letters || "";
  drawCharts(o.series);
  performance.clearMarks("tokenfleet:overview-drawn"); // the page's own timing (bench/dashboard.py reads it)
  performance.mark("tokenfleet:overview-drawn");
}

// -- dead letters, jobs, actions -------------------------------------------------------------

async function act(path, method = "POST") {
  try {
    const outcome = await api(path, method);
    $("#action-result").textContent = "done: " + JSON.stringify(outcome);
  } catch (e) {
    $("#action-result").textContent = "refused: " + e.message;
  }
  refresh();
}

function deadRow(d) {
  const id = encodeURIComponent(d.id);
  return el("tr", { "data-letter": d.id, "data-request": d.request_id || "" },
    el("td", {}, when(d.at)), el("td", {}, d.request_id || "-"), el("td", {}, d.code),
    el("td", { class: "reason" }, d.reason), el("td", {}, d.stream.split(":req:")[1] || d.stream), el("td", {}, d.worker),
    el("td", {},
      el("button", { onclick: () => inspect(d.id) }, "Inspect"),
      el("button", { class: "act", onclick: () => act(`/dead/${id}/requeue`), disabled: d.requeueable ? null : "",
        title: d.requeueable ? null : d.why_not_requeueable }, "Requeue"),
      el("button", { class: "act danger", onclick: () => act(`/dead/${id}`, "DELETE") }, "Delete")));
}

async function inspect(id) {
  const entry = await api("/dead/" + encodeURIComponent(id));
  $("#dead-entry").hidden = false;
  $("#dead-entry").textContent = JSON.stringify(entry, null, 2);
}

function jobRow(j) {
  const done = j.total ? (j.completed + j.failed) / j.total : j.status === "completed" || j.status === "finished" ? 1 : 0;
  return el("tr", { "data-job": j.id, class: "job-" + j.status },
    el("td", {}, j.id, el("div", { class: "quiet" }, j.endpoint || "")), el("td", {}, j.kind),
    el("td", { class: "status" }, j.status),
    el("td", {}, el("span", { class: "bar" }, el("span", { style: `width:${Math.round(done * 100)}%` })),
      ` ${j.completed + j.failed}/${j.total}`),
    el("td", { class: "num" }, j.failed), el("td", { class: "reason" }, (j.errors || []).join("; ")),
    el("td", {}, when(j.created_at)),
    el("td", {}, j.cancellable ? el("button", { class: "act danger", onclick: () => act(`/jobs/${encodeURIComponent(j.id)}/cancel`) }, "Cancel") : null));
}

async function refresh() {
  if ($("#app").hidden || document.hidden) return; // a page in a background tab asks nothing
  try {
    if (state.tab === "overview") await refreshOverview();
    else {
      const o = await api("/dead?count=1");
      $("#dead-count").textContent = o.total || "";
    }
    if (state.tab === "dead") {
      const d = await api("/dead");
      fill("#dead", d.data.map(deadRow));
      $("#dead-note").textContent = d.total > d.data.length ? `newest ${d.data.length} of ${d.total}` : "";
    } else if (state.tab === "jobs") {
      fill("#jobs", (await api("/jobs")).data.map(jobRow));
    } else if (state.tab === "audit") {
      fill("#audit", (await api("/audit")).data.map((a) => el("tr", {},
        el("td", {}, when(a.at)), el("td", {}, a.who), el("td", {}, a.action), el("td", {}, a.target), el("td", { class: "reason" }, a.outcome))));
    }
    $("#updated").textContent = "updated " + new Date().toLocaleTimeString();
    $("#updated").classList.remove("error");
  } catch (e) {
    if (e.status === 401) return signIn();
    $("#updated").textContent = "refresh failed: " + e.message;
    $("#updated").classList.add("error");
  }
}

// -- wiring ----------------------------------------------------------------------------------

function start() {
  const fromLink = new URLSearchParams(location.hash.slice(1)).get("key"); // #key=...: never sent to a server
  if (fromLink) {
    sessionStorage.setItem("tokenfleet-key", fromLink);
    history.replaceState(null, "", location.pathname + location.search);
  }
  state.key = sessionStorage.getItem("tokenfleet-key");
  $("#login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("#key").value.trim();
    sessionStorage.setItem("tokenfleet-key", state.key);
    signIn();
  });
  $("#fleet").addEventListener("change", (e) => { state.fleet = e.target.value; refresh(); });
  $("#show-empty").addEventListener("change", refresh);
  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => {
      state.tab = button.dataset.tab;
      for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("on", b === button);
      for (const section of document.querySelectorAll(".tab")) section.hidden = section.id !== "tab-" + state.tab;
      refresh();
    });
  }
  $("#lookup-form").addEventListener("submit", (e) => { e.preventDefault(); lookUp($("#request-id").value.trim()); });
  $("#requeue-all").addEventListener("click", () => confirm("Requeue every dead letter?") && act("/dead-all/requeue"));
  $("#delete-all").addEventListener("click", () => confirm("Delete every dead letter?") && act("/dead-all/delete"));
  signIn();
  setInterval(refresh, POLL_MS);
  document.addEventListener("visibilitychange", refresh); // back in front: fresh at once
}

start();
