// The node's status page: GET /v1/status every 2 s, drawn with text nodes only (table names
// and error messages come from clients: never markup).
"use strict";

const KEY = "deltaflow-token";
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    if (cell instanceof Node) {
      const td = document.createElement("td");
      td.appendChild(cell);
      tr.appendChild(td);
    } else {
      const [text, cls] = Array.isArray(cell) ? cell : [cell, ""];
      tr.appendChild(el("td", text, cls));
    }
  }
  return tr;
}

const num = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
const secs = (s) => (s === null || s === undefined ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);

function ago(at, now) {
  if (!at) return "never";
  const s = Math.max(0, now - at);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

function badge(text, cls) {
  return el("span", text, `badge ${cls}`);
}

function chart(recent) {
  // Rows of each of the latest commits, oldest first: a small bar chart.
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  const width = 160, height = 24, n = Math.max(recent.length, 1);
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("role", "img");
  const top = Math.max(1, ...recent.map((c) => c.rows));
  svg.setAttribute("aria-label", `rows of the latest ${recent.length} commits, up to ${top}`);
  recent.forEach((c, i) => {
    const bar = document.createElementNS(ns, "rect");
    const h = Math.max(1, Math.round((c.rows / top) * height));
    bar.setAttribute("x", (i * width) / n);
    bar.setAttribute("y", height - h);
    bar.setAttribute("width", Math.max(1, width / n - 1));
    bar.setAttribute("height", h);
    const title = document.createElementNS(ns, "title");
    title.textContent = `v${c.version ?? "?"}: ${c.rows} rows in ${secs(c.seconds)}`;
    bar.appendChild(title);
    svg.appendChild(bar);
  });
  return svg;
}

function fill(tbody, rows, columns) {
  tbody.replaceChildren(...rows);
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = el("td", "none yet", "empty");
    td.colSpan = columns;
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

function draw(s) {
  $("node").textContent = s.node;
  $("state").replaceWith(Object.assign(badge(s.state, s.state), { id: "state" }));
  const ready = s.ready.ready ? badge("ready", "ready") : badge("not ready", "not-ready");
  $("ready").replaceWith(Object.assign(ready, { id: "ready" }));
  $("summary").textContent =
    `${s.address} · up ${Math.round(s.uptime_seconds)} s · ${s.streams} streams · ` +
    `${s.connections} connections · map v${s.map_version}`;
  fill($("members").tBodies[0], s.members.map((m) => row([
    m.node + (m.self ? " (this node)" : ""),
    m.address,
    badge(m.state, m.state),
    [num(m.partitions), "num"],
    [m.self ? "–" : m.last_seen_ago === null ? "never" : `${m.last_seen_ago} s ago`, "num"],
  ])), 5);
  fill($("tables").tBodies[0], Object.entries(s.tables).map(([name, t]) => row([
    name,
    t.committer ?? "–",
    [num(t.version), "num"],
    [num(t.rows_per_second), "num"],
    [num(t.rows), "num"],
    [num(t.commits), "num"],
    [`${secs(t.time_to_table.p50)} / ${secs(t.time_to_table.p99)}`, "num"],
    [secs(t.commit_seconds.p99), "num"],
    [num(t.queued_rows), "num"],
    [num(t.in_flight_batches), "num"],
    [ago(t.last_commit_at, s.now), "num"],
    chart(t.recent),
  ])), 12);
  fill($("receivers").tBodies[0], Object.entries(s.receivers).map(([name, r]) => row([
    name,
    [num(r.batches_acked), "num"],
    [num(r.batches_failed), "num"],
    [num(r.items_applied), "num"],
    [num(r.items_failed), "num"],
    [num(r.running), "num"],
  ])), 6);
  const errors = s.recent_errors.map((e) => {
    const li = document.createElement("li");
    li.append(el("span", `${ago(e.at, s.now)} `, "sub"), el("code", e.code), el("span", ` ${e.message}`));
    return li;
  });
  $("errors").replaceChildren(...(errors.length ? errors : [el("li", "none", "empty")]));
  $("updated").textContent = `updated ${new Date(s.now * 1000).toISOString()} · every 2 s`;
}

async function refresh() {
  const token = sessionStorage.getItem(KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  try {
    const resp = await fetch("/v1/status", { headers, cache: "no-store" });
    if (resp.status === 401) {
      sessionStorage.removeItem(KEY);
      $("status").hidden = true;
      $("login").style.display = "block";
      if (token) $("login-error").textContent = "That token was refused.";
      return;
    }
    draw(await resp.json());
    $("login").style.display = "none";
    $("status").hidden = false;
  } catch (err) {
    $("updated").textContent = `the node does not answer (${err}); trying again`;
  }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("token").value.trim());
  $("token").value = "";
  refresh();
});

refresh();
setInterval(refresh, 2000);
