// fedmqtt dashboard: renders the server's JSON snapshots. Everything from the broker is untrusted text:
// it only ever reaches the page through textContent / setAttribute on fixed names, never parsed as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}
function fmtNum(x, digits = 3) { return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–"; }
function fmtBytes(n) {
  if (typeof n !== "number" || !isFinite(n)) return "–";
  if (n < 1024) return n + " B";
  if (n < 1024 * 1024) return (n / 1024).toFixed(1) + " KiB";
  return (n / 1024 / 1024).toFixed(1) + " MiB";
}
function fmtDur(s) {
  if (typeof s !== "number" || !isFinite(s)) return "–";
  if (s < 90) return s.toFixed(1) + " s";
  if (s < 5400) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function fmtAgo(t, now) { return typeof t === "number" ? fmtDur(Math.max(0, now - t)) + " ago" : "never"; }

// What each run status means on the page (state.py's RunView.status decides which applies).
const STATUS_TEXT = {
  live: "live", finished: "finished", offline: "offline: the PS is gone before the end",
  error: "stopped: the PS reported an error", waiting: "waiting: no PS status on the broker yet",
  unknown: "unknown: the broker is unreachable",
};

function overallStatus(runs) {
  const kinds = [...new Set(runs.map((r) => r.status))];
  return kinds.length === 1 ? kinds[0] : "mixed";
}

function facts(pairs) {
  const dl = el("dl", { class: "facts" });
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", {}, v));
  return dl;
}

function runFacts(run, now) {
  const pairs = [
    ["status", STATUS_TEXT[run.status] || run.status],
    ["source", run.source === "live" ? "live from the broker (observer)" : "finished run (report.json)"],
    ["algorithm", run.algorithm || "–"],
    ["round", `${run.round} of ${run.rounds_total || "?"}`],
    ["phase", run.ps.state + (run.ps.detail ? ` — ${run.ps.detail}` : "")],
    ["time per round", fmtDur(run.seconds_per_round)],
    ["time to finish", run.eta_s == null ? "–" : fmtDur(run.eta_s) + " at the current pace"],
    ["quorum", run.quorum ? `${run.quorum} of ${run.sites_expected.length} (updates that close a round at its deadline)` : "–"],
    ["min sites", run.min_sites ? `${run.min_sites} of ${run.sites_expected.length} online before round 1` : "–"],
  ];
  if (run.source === "live") {
    pairs.push(["sites online", `${run.sites_online.length} of ${run.sites_expected.length}`]);
    pairs.push(["waiting for", run.waiting_for.length ? run.waiting_for.join(", ") : "–"]);
    if ((run.upload_turns || []).length) pairs.push(["uploading now", run.upload_turns.join(", ")]);
    pairs.push(["deadline", run.deadline ? new Date(run.deadline * 1000).toLocaleTimeString() +
                ` (in ${fmtDur(run.deadline - now)})` : "–"]);
    pairs.push(["PS last seen", fmtAgo(run.ps.last_seen, now)]);
  }
  if (run.best_round) pairs.push(["best round", `${run.best_round.round} (${run.best_round.metric} ${fmtNum(run.best_round.score)})`]);
  if (run.invalid) pairs.push(["invalid messages", `${run.invalid} dropped: ` +
      Object.entries(run.invalid_reasons).map(([k, v]) => `${k} ×${v}`).join(", ")]);
  return facts(pairs);
}

function lastUpdate(run, site) {
  for (let i = run.rounds.length - 1; i >= 0; i--) {
    const m = run.rounds[i].per_site[site];
    if (m) return `r${run.rounds[i].round}: loss ${fmtNum(m.loss)}` + (m.auroc != null ? `, auroc ${fmtNum(m.auroc)}` : "");
  }
  return "–";
}

function sitesTable(run, now) {
  const table = el("table", { class: "sites" });
  table.append(el("tr", {}, ...["site", "state", "last seen", "rounds", "last update (val)", "data", "rejected", "usage", "detail"]
    .map((h) => el("th", {}, h))));
  for (const s of run.sites) {
    const rejected = Object.entries(s.rejected || {}).map(([k, v]) => `${k} ×${v}`).join(", ") || "–";
    const parts = [];
    if (Object.keys(s.usage || {}).length) {
      parts.push(`total CPU ${fmtNum(s.usage.cpu_s, 1)} s` + (s.usage.energy_j ? `, GPU ${fmtNum(s.usage.energy_j, 0)} J` : ""));
    }
    if (s.last_compute && s.last_compute.wall_s != null) {
      parts.push(`last round ${fmtNum(s.last_compute.wall_s, 1)} s (CPU ${fmtNum(s.last_compute.cpu_s, 1)} s` +
        (s.last_compute.energy_j != null ? `, ${fmtNum(s.last_compute.energy_j, 0)} J)` : ")"));
    }
    if (s.last_update_bytes != null) {
      parts.push(`update ${fmtBytes(s.last_update_bytes)}`);
    }
    const usage = parts.join("; ") || "–";
    const row = el("tr", { "data-site": s.name },
      el("td", {}, s.name),
      el("td", {}, el("span", { class: "state state-" + (/^[a-z]+$/.test(s.state) ? s.state : "unknown") }, s.state)),
      el("td", {}, run.source === "live" ? fmtAgo(s.last_seen, now) : "–"),
      el("td", {}, String(s.rounds_participated)),
      el("td", {}, lastUpdate(run, s.name)),
      el("td", {}, s.n_train ? `${s.n_train} train / ${s.n_val} val (${s.device})` : "–"),
      el("td", { class: "rejected" }, rejected),
      el("td", {}, usage),
      el("td", { class: "detail" }, s.detail || ""));
    table.append(row);
  }
  return table;
}

function plot(title, series, bestRound) {
  // series: [{name, points: [[round, value]...]}]; a plain SVG line chart, best round marked.
  const W = 280, H = 150, L = 40, R = 8, T = 8, B = 22;
  const all = series.flatMap((s) => s.points);
  const fig = el("figure", { class: "plot" });
  fig.append(el("figcaption", {}, title));
  if (!all.length) { fig.append(el("p", { class: "warn" }, "no rounds yet")); return fig; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img" });
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#aab" }), svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#aab" }));
  for (const [v, y] of [[y1, T + 8], [y0, H - B]]) { const t = svg("text", { x: 2, y }); t.textContent = fmtNum(v, 2); root.append(t); }
  for (const [v, x] of [[x0, L], [x1, W - R - 14]]) { const t = svg("text", { x, y: H - 6 }); t.textContent = "r" + v; root.append(t); }
  if (bestRound != null && bestRound >= x0 && bestRound <= x1) {
    root.append(svg("line", { x1: sx(bestRound), x2: sx(bestRound), y1: T, y2: H - B, stroke: "#2a9d38", "stroke-dasharray": "3 2" }));
    const t = svg("text", { x: sx(bestRound) + 2, y: T + 8 }); t.textContent = "best"; root.append(t);
  }
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const color = s.name === "mean" ? "#111" : COLORS[i % COLORS.length];
    root.append(svg("polyline", { fill: "none", stroke: color, "stroke-width": s.name === "mean" ? 2.2 : 1.2,
      points: s.points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ") }));
    // A marker per round, so a series with a single round is visible too.
    s.points.forEach(([x, y]) => root.append(svg("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1),
      r: s.name === "mean" ? 2.5 : 1.8, fill: color })));
  });
  fig.append(root);
  const legend = el("div", { class: "legend" });
  series.forEach((s, i) => { const span = el("span", {}, s.name); span.style.color = s.name === "mean" ? "#111" : COLORS[i % COLORS.length]; legend.append(span); });
  fig.append(legend);
  return fig;
}

function plots(run) {
  const names = new Set();
  for (const r of run.rounds) Object.keys(r.mean || {}).forEach((k) => names.add(k));
  const sites = run.sites.map((s) => s.name);
  const best = run.best_round ? run.best_round.round : null;
  const box = el("div", { class: "plots" });
  const ordered = ["loss", ...[...names].filter((n) => n !== "loss").sort()].filter((n) => names.has(n));
  for (const metric of ordered.length ? ordered : ["loss"]) {
    const series = [{ name: "mean", points: run.rounds.filter((r) => typeof r.mean[metric] === "number").map((r) => [r.round, r.mean[metric]]) }];
    for (const site of sites) {
      series.push({ name: site, points: run.rounds.filter((r) => r.per_site[site] && typeof r.per_site[site][metric] === "number")
        .map((r) => [r.round, r.per_site[site][metric]]) });
    }
    box.append(plot(`validation ${metric}`, series, best));
  }
  return box;
}

function renderRun(run, now) {
  const sec = el("section", { class: "run", "data-run": run.run_id });
  const badgeClass = "badge badge-" + (/^[a-z]+$/.test(run.status) ? run.status : "unknown");
  sec.append(el("h2", {}, `run ${run.run_id}` + (run.source === "report" ? ` — ${run.label}` : "") + " ",
    el("span", { class: badgeClass }, run.status)));
  sec.append(runFacts(run, now));
  if (run.history_missing_before) {
    sec.append(el("p", { class: "warn history" }, `Rounds before ${run.history_missing_before} closed before this dashboard ` +
      "connected; the broker keeps only the last round's metrics, so their history is not available here " +
      "(open the finished run with --run for all rounds)."));
  }
  sec.append(el("h3", {}, "sites"), sitesTable(run, now));
  sec.append(el("h3", {}, "metrics per round"), plots(run));
  if (run.recruitment) sec.append(el("h3", {}, "recruitment"), el("pre", {}, JSON.stringify(run.recruitment, null, 2)));
  return sec;
}

function render(state) {
  const main = document.getElementById("runs");
  main.replaceChildren(...state.runs.map((r) => renderRun(r, state.now)));
  document.getElementById("note").textContent = state.note || "";
  const status = overallStatus(state.runs);
  const badge = document.getElementById("status");
  badge.textContent = status;
  badge.className = "badge badge-" + (/^[a-z]+$/.test(status) ? status : "unknown");
  document.body.setAttribute("data-updated", String(state.now));
}

function connect() {
  const source = new EventSource("/events");
  const conn = document.getElementById("conn");
  // #conn is about this page's link to the dashboard server only; whether the run is live is #status.
  source.onopen = () => { conn.textContent = "connected"; };
  source.onmessage = (ev) => { render(JSON.parse(ev.data)); conn.textContent = "updated " + new Date().toLocaleTimeString(); };
  source.onerror = () => { conn.textContent = "dashboard server unreachable: retrying"; };
}
document.addEventListener("DOMContentLoaded", connect);
