// Loom's live dashboard: one snapshot per server-sent event from /ui/events, drawn as tables and SVG.
"use strict";

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const fmt = (x, d = 0) =>
  x == null ? "–" : typeof x === "number" ? x.toLocaleString(undefined, { maximumFractionDigits: d }) : String(x);

function hue(key) {
  let h = 0;
  for (const c of key) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return h % 360;
}

function rows(table, items, cells, empty) {
  const body = $(table).querySelector("tbody");
  body.innerHTML = items.length
    ? items.map((it) => "<tr>" + cells(it).map((c) => `<td>${c}</td>`).join("") + "</tr>").join("")
    : `<tr><td class="empty" colspan="9">${esc(empty)}</td></tr>`;
}

function progress(done, failed, all) {
  const p = all ? (100 * done) / all : 0;
  const f = all ? (100 * failed) / all : 0;
  return `<div class="bar" title="${fmt(p, 1)}%"><i style="width:${p}%"></i><b style="left:${p}%;width:${f}%"></b></div>`;
}

function drawJobs(s) {
  rows("jobs", s.jobs.filter((j) => j.kind === "job"), (j) => [
    `<code>${esc(j.id)}</code>`, esc(j.name), esc(j.env), `<span class="state-${esc(j.state)}">${esc(j.state)}</span>`,
    progress(j.completed, j.failed, j.n), `${fmt(j.completed)} / ${fmt(j.failed)} / ${fmt(j.n)}`,
  ], "no jobs yet");
  rows("streams", s.streams, (st) => [
    `<code>${esc(st.id)}</code>`, esc(st.name), `<span class="state-${esc(st.state)}">${esc(st.state)}</span>`,
    fmt(st.version), fmt(st.delivered), fmt(st.open_groups), fmt(st.stale_groups),
  ], "no rollout streams");
}

function lanes(calls) {
  // Concurrent calls of a worker (a batch) stack in lanes: each call takes the first lane free at its start.
  const ends = [], placed = [];
  for (const c of [...calls].sort((a, b) => a[4] - b[4])) {
    let k = ends.findIndex((e) => e <= c[4]);
    if (k < 0) { k = ends.length; ends.push(0); }
    ends[k] = c[6];
    placed.push([k, c]);
  }
  return { n: Math.max(1, ends.length), placed };
}

function drawGantt(s) {
  const svg = $("gantt");
  const workers = [...new Set([...s.workers.map((w) => w.id), ...s.gantt.calls.map((c) => c[0])])].sort();
  const byWorker = new Map(workers.map((w) => [w, lanes(s.gantt.calls.filter((c) => c[0] === w))]));
  const laneH = (w) => Math.max(1.5, Math.min(12, 60 / byWorker.get(w).n));
  const rowH = (w) => Math.max(20, byWorker.get(w).n * laneH(w) + 6);
  const W = svg.clientWidth || 1000, left = 70, top = 6;
  const H = top + workers.reduce((a, w) => a + rowH(w), 0) + 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  const t0 = s.gantt.from, t1 = s.gantt.to, x = (t) => left + ((Math.max(t, t0) - t0) / Math.max(1e-9, t1 - t0)) * (W - left - 8);
  const out = [];
  let y0 = top;
  for (const w of workers) {
    const { n, placed } = byWorker.get(w), lh = laneH(w), h = rowH(w);
    out.push(`<text x="4" y="${y0 + h / 2 + 4}">${esc(w)}</text><text x="4" y="${y0 + h / 2 + 16}">${n} lanes</text>`);
    out.push(`<line x1="${left}" x2="${W - 8}" y1="${y0 + h}" y2="${y0 + h}" stroke="#e3e6ee"/>`);
    for (const [k, [, job, traj, step, q, g, e]] of placed) {
      const y = y0 + 3 + k * lh, color = `hsl(${hue(job + traj)},60%,55%)`;
      const tip = `<title>${esc(job)} ${esc(traj)} call ${step}: queued ${fmt(g - q, 2)} s, generating ${fmt(e - g, 2)} s</title>`;
      out.push(`<rect x="${x(q)}" y="${y}" width="${Math.max(0.5, x(g) - x(q))}" height="${lh * 0.85}" fill="${color}" opacity="0.3">${tip}</rect>`);
      out.push(`<rect x="${x(g)}" y="${y}" width="${Math.max(1, x(e) - x(g))}" height="${lh * 0.85}" fill="${color}">${tip}</rect>`);
    }
    y0 += h;
  }
  for (let k = 0; k <= 4; k++) {
    const t = t0 + ((t1 - t0) * k) / 4;
    out.push(`<text x="${x(t) - 12}" y="${H - 6}">${k === 4 ? "now" : fmt(t - t1, 0) + " s"}</text>`);
  }
  if (!s.gantt.calls.length) out.push(`<text x="${left}" y="${top + 15}">no model calls in this window</text>`);
  svg.innerHTML = out.join("");
}

function drawWorkers(s) {
  rows("workers", s.workers, (w) => [
    esc(w.id), fmt(w.running), fmt(w.waiting),
    progress(w.kv_used, 0, w.kv_capacity) + ` ${fmt((100 * w.kv_used) / Math.max(1, w.kv_capacity), 0)}%`, fmt(w.tokens_per_s),
  ], "no rollout workers");
}

function drawThroughput(s) {
  const svg = $("throughput"), pts = s.throughput, W = svg.clientWidth || 500, H = 160, pad = 30;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  const last = pts.length ? pts[pts.length - 1][1] : 0;
  $("tput").textContent = `${fmt(last)} tokens/s now`;
  if (pts.length < 2) { svg.innerHTML = `<text x="${pad}" y="20">waiting for worker telemetry</text>`; return; }
  const t0 = pts[0][0], t1 = pts[pts.length - 1][0], m = Math.max(1, ...pts.map((p) => p[1]));
  const x = (t) => pad + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - pad - 6), y = (v) => H - 18 - (v / m) * (H - 30);
  const d = pts.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
  svg.innerHTML = `<path d="${d}" fill="none" stroke="#3b6fd8" stroke-width="2"/>` +
    `<text x="2" y="14">${fmt(m)}</text><text x="2" y="${H - 18}">0</text><text x="${pad}" y="${H - 3}">${fmt(t0 - t1)} s</text><text x="${W - 30}" y="${H - 3}">now</text>`;
}

function drawLengths(s) {
  const svg = $("lengths"), pts = s.lengths, W = svg.clientWidth || 500, H = 220, pad = 40;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  $("lengths-n").textContent = `(${pts.length} trajectories; x predicted at the first tool call, y actual tokens)`;
  if (!pts.length) { svg.innerHTML = `<text x="${pad}" y="20">no finished trajectory with a prediction yet</text>`; return; }
  const m = Math.max(1, ...pts.flat());
  const x = (v) => pad + (v / m) * (W - pad - 10), y = (v) => H - 20 - (v / m) * (H - 30);
  const dots = pts.map(([p, a]) => `<circle cx="${x(p).toFixed(1)}" cy="${y(a).toFixed(1)}" r="2.5" fill="#3b6fd8" opacity="0.6"/>`).join("");
  svg.innerHTML = `<line x1="${x(0)}" y1="${y(0)}" x2="${x(m)}" y2="${y(m)}" stroke="#d04b4b" stroke-dasharray="4 3"/>${dots}` +
    `<text x="2" y="14">${fmt(m)}</text><text x="${W - 60}" y="${H - 4}">${fmt(m)}</text><text x="${pad}" y="${H - 4}">0</text>`;
}

function drawReward(s) {
  const r = s.reward, box = $("reward");
  if (!r) { box.innerHTML = `<p class="empty">the reward service does not answer</p>`; return; }
  const ready = (r.workers || []).filter((w) => w.ready).length;
  const pending = Object.values(r.tenants || {}).reduce((a, t) => a + t.pending, 0);
  const kv = [["mode", r.mode], ["workers ready / live", `${ready} / ${(r.workers || []).length}`], ["peak workers", r.peak_workers],
    ["requests waiting", pending], ["utilization", r.utilization == null ? "–" : `${fmt(100 * r.utilization, 0)}%`],
    ["cold starts", r.cold_starts], ["killed (hung)", r.killed]];
  box.innerHTML = `<div class="kv">${kv.map(([k, v]) => `<span>${esc(k)}</span><span>${esc(fmt(v))}</span>`).join("")}</div>`;
}

function drawRollmux(s) {
  $("rollmux-box").hidden = s.rollmux == null;
  if (s.rollmux == null) return;
  rows("rollmux", s.rollmux, (g) => [
    esc(g.group), esc(g.jobs.join(", ")), esc(Object.keys(g.rollout_nodes).length), esc(g.train_nodes.length ?? g.train_nodes),
    fmt(g.period_s, 1), fmt(g.cost_per_hour, 2), g.saturated ? "yes" : "no",
  ], "no co-scheduled RL jobs");
}

function draw(s) {
  $("who").textContent = `tenant: ${s.tenant}`;
  $("clock").textContent = `simulated time ${new Date(s.now * 1000).toLocaleTimeString()}`;
  for (const f of [drawJobs, drawGantt, drawWorkers, drawThroughput, drawLengths, drawReward, drawRollmux]) {
    try { f(s); } catch (e) { console.error(f.name, e); }
  }
  document.body.dataset.updated = String(Date.now());
}

function connect() {
  const live = $("live"), es = new EventSource("/ui/events");
  es.onopen = () => { live.textContent = "live"; live.className = ""; };
  es.onmessage = (ev) => draw(JSON.parse(ev.data));
  es.onerror = () => { live.textContent = "reconnecting"; live.className = "off"; };
}

// The page arrives with a snapshot inside, drawn before it has loaded; the events keep it live.
if (window.LOOM_STATE) draw(window.LOOM_STATE);
connect();
