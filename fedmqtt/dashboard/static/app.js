// fedmqtt dashboard: renders the server's JSON snapshots. Everything from the broker or a report is untrusted
// text: it only ever reaches the page through textContent / setAttribute on fixed names, never parsed as HTML,
// and every party-provided string goes through party(): bidirectionally isolated, its bidi controls shown as
// visible codes, truncated by CSS with the full text on hover.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const MEAN_COLOR = "#111111";
// Explicit direction controls (LRM, RLM, ALM, embeddings, overrides, isolates): shown, never obeyed.
const BIDI_CONTROLS = /[\u061C\u200E\u200F\u202A-\u202E\u2066-\u2069]/g;
const MAX_EVENTS = 1000;
const EVENTS_SHOWN = 300;

// -- DOM helpers -------------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v != null) node.setAttribute(k, v);
  for (const c of children.flat(Infinity)) if (c != null) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}
function svgText(x, y, text, attrs) { const t = svg("text", { x, y, ...(attrs || {}) }); t.textContent = text; return t; }
function visible(text) {
  return String(text ?? "").replace(BIDI_CONTROLS, (c) => `⟨U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}⟩`);
}
// A string a party chose (site names, devices, details, reasons, labels): isolated, cut short, whole on hover.
function party(text, cls) {
  const shown = visible(text);
  return el("bdi", { class: "party" + (cls ? " " + cls : ""), title: shown }, shown);
}
function partyList(names) {
  if (!names || !names.length) return "–";
  const out = [];
  names.forEach((n, i) => { if (i) out.push(", "); out.push(party(n)); });
  return el("span", { class: "list" }, out);
}
function scroller(table) { return el("div", { class: "scroll" }, table); }

// -- formatting --------------------------------------------------------------------------------------------
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
// Compute times of a small model are milliseconds: never "0.0 s".
function fmtSecs(s) {
  if (typeof s !== "number" || !isFinite(s)) return "–";
  if (s === 0) return "0 s";
  if (s < 0.001) return "<1 ms";
  if (s < 0.01) return (s * 1000).toFixed(1) + " ms";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  return fmtDur(s);
}
function fmtAgo(t, now) { return typeof t === "number" ? fmtDur(Math.max(0, now - t)) + " ago" : "never"; }
function fmtClock(t) { return typeof t === "number" ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "–"; }
function fmtWhen(t) { return typeof t === "number" ? new Date(t * 1000).toLocaleString() : "–"; }
function word(s) { return /^[a-z_]+$/.test(s) ? s : "unknown"; }

// What each run status means on the page (state.py's RunView.status decides which applies).
const STATUS_TEXT = {
  live: "live", finished: "finished", offline: "offline: the PS is gone before the end",
  error: "stopped: the PS reported an error", waiting: "waiting: no PS status on the broker yet",
  unknown: "unknown: the broker is unreachable",
};

// -- the data: whole snapshots, then only what changed ------------------------------------------------------
const store = { runs: new Map(), note: "", now: 0 };
const ui = { selected: null, compare: null, hidden: new Map(), compareMetric: null, hiddenKinds: new Set(), hiddenRuns: new Set() };

function merge(update) {
  if (!update.delta) store.runs = new Map();
  for (const r of update.runs) {
    const old = store.runs.get(r.key);
    if (!update.delta || !old) {
      r.byRound = new Map(r.rounds.map((x) => [x.round, x]));
      r.eventList = r.events.slice(-MAX_EVENTS);
      store.runs.set(r.key, r);
      continue;
    }
    for (const x of r.rounds) old.byRound.set(x.round, x);
    old.eventList.push(...r.events);
    if (old.eventList.length > MAX_EVENTS) old.eventList.splice(0, old.eventList.length - MAX_EVENTS);
    for (const [k, v] of Object.entries(r)) if (k !== "rounds" && k !== "events") old[k] = v;
  }
  for (const r of store.runs.values()) r.rounds = [...r.byRound.values()].sort((a, b) => a.round - b.round);
  store.note = update.note || "";
  store.now = update.now;
}

// -- run facts ---------------------------------------------------------------------------------------------
function facts(pairs) {
  const dl = el("dl", { class: "facts" });
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", { "data-fact": k }, v));
  return dl;
}
// "done — done" said nothing: the detail is shown only where it adds to the phase.
function phase(ps) {
  const state = ps.state.replaceAll("_", " ");
  let detail = ps.detail || "";
  if (detail === ps.state || detail === state) detail = "";
  else if (detail.startsWith(ps.state + "; ")) detail = detail.slice(ps.state.length + 2);
  return detail ? el("span", {}, state + " — ", party(detail)) : state;
}
function bestText(run) {
  const b = run.best_round;
  if (!b) {
    if (run.source === "live" && !run.selection_metric) return "– (this PS does not say its selection metric on ps/status)";
    return "–";
  }
  return `round ${b.round} by ${b.metric} = ${fmtNum(b.score)}` + (b.note ? ` (${b.note})` : "") +
    (run.source === "report" ? " (the report's)" : " (the PS's rule: " + (b.rule || "") + ")");
}
function refusedTotal(run) {
  let n = 0;
  for (const s of run.sites) for (const v of Object.values(s.rejected || {})) n += v;
  return n;
}
function dropped(run) {
  if (!run.invalid) return null;
  const box = el("span", { class: "list" }, `${run.invalid}: `);
  run.dropped.forEach((d, i) => {
    if (i) box.append("; ");
    box.append("from ", party(d.sender), ": ", party(d.reason), ` ×${d.count} `, el("span", { class: "muted" }, "(last: "), party(d.last), el("span", { class: "muted" }, ")"));
  });
  return box;
}
// Selected sites the PS no longer waits for (ps/status `dropped`), each with the PS's reason.
function droppedSites(list) {
  const box = el("span", { class: "list", "data-dropped": "" });
  list.forEach((d, i) => { if (i) box.append("; "); box.append(party(d.site), ": ", party(d.why)); });
  return box;
}
// Secure aggregation: on or off, and how the last closed round's sum went (the PS saw only sums).
function secureText(run) {
  if (!run.secure_aggregation) return "off (the PS sees each site's update)";
  const last = run.secure_last_round;
  if (!last) return "on (the PS sees only sums); no round closed yet";
  return `on (the PS sees only sums); round ${last.round}: ${last.included} site(s) in the sum, ${last.dropped} dropped, ` +
    `${last.recovered} recovered` + (last.tries > 1 ? `, after ${last.tries} tries` : "");
}

// Participant-level DP (DP-FedAvg): what every model released so far has cost each hospital's whole data.
function fmtDelta(x) { return typeof x === "number" && isFinite(x) ? x.toExponential().replace("e+", "e") : "–"; }
function participantText(run) {
  const p = run.participant_dp;
  if (!p) return null;
  const rounds = typeof p.rounds === "number" && isFinite(p.rounds) ? p.rounds : "?";
  return el("span", { title: "participant-level DP: epsilon at delta of all the models the PS released so far, against one hospital's whole data set, " +
      "by the PS's accountant with no amplification by sampling (q = 1)" },
    `ε ${fmtNum(p.epsilon, 2)} at δ ${fmtDelta(p.delta)} after ${rounds} round${rounds === 1 ? "" : "s"} (${word(p.accountant)} accountant)`);
}

function runFacts(run, now) {
  const pairs = [
    ["status", STATUS_TEXT[run.status] || run.status],
    ["source", run.source === "live" ? "live from the broker (observer)" : "finished run (report.json)"],
    ["algorithm", run.algorithm ? party(run.algorithm) : "–"],
    ["round", `${run.round} of ${run.rounds_total || "?"}`],
    ["phase", phase(run.ps)],
    ["time per round", fmtDur(run.seconds_per_round)],
  ];
  if (run.source === "live") pairs.push(["time to finish", run.eta_s == null ? "–" : fmtDur(run.eta_s) + " at the current pace"]);
  pairs.push(["quorum", run.quorum ? `${run.quorum} of ${run.sites_expected.length} (updates that close a round at its deadline)` : "–"]);
  pairs.push(["min sites", run.min_sites ? `${run.min_sites} of ${run.sites_expected.length} online before round 1` : "–"]);
  pairs.push(["secure aggregation", secureText(run)]);
  const participant = participantText(run);
  if (participant) pairs.push(["participant-level DP", participant]);
  if (run.source === "live") {
    pairs.push(["sites online", `${run.sites_online.length} of ${run.sites_expected.length}`]);
    pairs.push(["waiting for", partyList(run.waiting_for)]);
    if ((run.sites_dropped || []).length) pairs.push(["dropped by the PS", droppedSites(run.sites_dropped)]);
    if ((run.upload_turns || []).length) pairs.push(["uploading now", partyList(run.upload_turns)]);
    pairs.push(["deadline", run.deadline ? `${fmtClock(run.deadline)} (in ${fmtDur(run.deadline - now)})` : "–"]);
    pairs.push(["PS last seen", fmtAgo(run.ps.last_seen, now)]);
  } else {
    pairs.push(["finished", fmtWhen(run.finished_at)]);
  }
  pairs.push(["best round", bestText(run)]);
  const refused = refusedTotal(run);
  if (refused) pairs.push(["refused by the PS", `${refused} message${refused > 1 ? "s" : ""} (per site and reason in the sites table and the timeline)`]);
  const drops = dropped(run);
  if (drops) pairs.push(["dropped by this page", drops]);
  return facts(pairs);
}

// -- results of a finished run -----------------------------------------------------------------------------
function resultsTable(model, results, run) {
  const metrics = results.metrics;
  const table = el("table", { class: "results", "data-model": model.model });
  let caption = `${model.title}` + (model.round != null ? ` (round ${model.round})` : "");
  if (model.model === "best" && model.metric) caption += ` — chosen by ${model.metric}, the run's selection metric`;
  table.append(el("caption", {}, caption));
  table.append(el("tr", {}, el("th", {}, "site"), el("th", { class: "num" }, "n test"),
    ...metrics.map((m) => el("th", { class: "num" }, "test " + m)), el("th", {}, "note")));
  for (const row of [...model.rows, ...results.references]) {
    const tr = el("tr", { class: "row-" + row.kind, "data-row": row.kind, "data-label": row.label },
      el("td", {}, party(row.label)), el("td", { class: "num" }, row.n == null ? "" : String(row.n)));
    for (const m of metrics) {
      const c = row.cells[m] || { text: "n/a", value: null };
      tr.append(el("td", { class: "num", "data-metric": m, title: c.value == null ? null : String(c.value) }, c.text));
    }
    tr.append(el("td", {}, row.note ? party(row.note, "note") : ""));
    table.append(tr);
  }
  return scroller(table);
}
function downloads(run) {
  if (!run.files || !run.files.length) return el("p", { class: "muted" }, "No files to download in this run's folder.");
  const ul = el("ul", { class: "downloads" });
  for (const f of run.files) {
    ul.append(el("li", {}, el("a", { href: `/runs/${run.key}/files/${encodeURIComponent(f.name)}`, download: f.name }, f.name),
      ` (${fmtBytes(f.bytes)}): ${f.what}`));
  }
  return ul;
}
// A live run that finished: the final model's test metrics as ps/metrics carried them.
function liveResults(run) {
  const f = run.final;
  const metrics = [...new Set(Object.values(f.per_site || {}).flatMap((m) => Object.keys(m)))].sort();
  const table = el("table", { class: "results", "data-model": "final-live" });
  table.append(el("caption", {}, "final model, test split (from ps/metrics)"));
  table.append(el("tr", {}, el("th", {}, "site"), ...metrics.map((m) => el("th", { class: "num" }, "test " + m))));
  const rows = [...Object.entries(f.per_site || {}).map(([s, m]) => ["site", s, m]), ["mean", "mean", f.mean || {}]];
  for (const [kind, label, m] of rows) {
    table.append(el("tr", { class: "row-" + kind, "data-row": kind, "data-label": label }, el("td", {}, party(label)),
      ...metrics.map((k) => el("td", { class: "num", "data-metric": k, title: m[k] == null ? null : String(m[k]) }, m[k] == null ? "n/a" : fmtNum(m[k])))));
  }
  return el("div", {}, scroller(table), el("p", { class: "muted" }, "Sample counts, the best-round model, the reference rows and the " +
    "downloads are in the PS's report.json: open its out_dir with --run."));
}
function resultsPanel(run) {
  const r = run.results;
  const box = el("div", { class: "results-panel" });
  if (!r) return box;
  box.append(el("p", { class: "muted" }, "Test split of every site: the final model and the best-round model, per site with its test rows (n), " +
    "their unweighted mean, and the report's reference rows. Hover a number for its full value."));
  for (const model of r.models) box.append(resultsTable(model, r, run));
  if (r.models.length < 2) box.append(el("p", { class: "muted" }, "No best-round evaluation in this report (the sites report it when the run selects a best round)."));
  for (const n of r.notes) box.append(el("p", { class: "muted" }, party(n, "wrap")));
  for (const w of r.warnings) box.append(el("p", { class: "warn" }, "Warning: ", party(w, "wrap")));
  box.append(el("h4", {}, "downloads"), downloads(run));
  return box;
}

// -- plots -------------------------------------------------------------------------------------------------
function niceStep(span, count) {
  const raw = span / count, mag = 10 ** Math.floor(Math.log10(raw)), n = raw / mag;
  return (n <= 1 ? 1 : n <= 2 ? 2 : n <= 2.5 ? 2.5 : n <= 5 ? 5 : 10) * mag;
}
function axisTicks(lo, hi, count, integer) {
  let step = niceStep(hi - lo || Math.abs(hi) || 1, count);
  if (integer) step = Math.max(1, Math.round(step));
  const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
  const values = [];
  for (let v = first; v <= last + step * 1e-6; v += step) values.push(Number(v.toPrecision(12)));
  return { step, values, lo: first, hi: last };
}
function fmtTick(v, step) { return v.toFixed(Math.min(6, Math.max(0, -Math.floor(Math.log10(step) + 1e-9)))); }

// A line (or bar) chart: ticks with values on both axes, a marker per point with its value, a crosshair that
// lists every shown series' value at the round under the pointer, and the best round marked.
function chart({ title, series, best, bars, yLabel, key, wide }) {
  const W = wide ? 720 : 420, H = wide ? 280 : 230, L = 54, R = 12, T = 12, B = 40;
  const fig = el("figure", { class: "plot", "data-plot": key || title });
  fig.append(el("figcaption", {}, title));
  const shown = series.filter((s) => !s.hidden && s.points.length);
  const all = shown.flatMap((s) => s.points);
  if (!all.length) { fig.append(el("p", { class: "muted" }, series.some((s) => s.points.length) ? "every series is hidden" : "no rounds yet")); return fig; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  if (bars) { x0 -= 0.5; x1 += 0.5; } else if (x0 === x1) { x0 -= 1; x1 += 1; }
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (bars) y0 = 0;
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 0.5; y1 += Math.abs(y1) * 0.1 || 0.5; }
  const yt = axisTicks(y0, y1, 5, false);
  const xt = axisTicks(Math.max(x0, bars ? x0 : -Infinity), x1, Math.min(8, Math.max(1, Math.ceil(x1 - x0))), true);
  [y0, y1] = [yt.lo, yt.hi];
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title, class: "chart" });
  for (const v of yt.values) {
    root.append(svg("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid" }));
    root.append(svgText(L - 4, sy(v) + 3, fmtTick(v, yt.step), { class: "tick", "text-anchor": "end" }));
  }
  for (const v of xt.values) {
    if (v < x0 || v > x1) continue;
    root.append(svg("line", { x1: sx(v), x2: sx(v), y1: H - B, y2: H - B + 4, class: "axis" }));
    root.append(svgText(sx(v), H - B + 15, String(v), { class: "tick", "text-anchor": "middle" }));
  }
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }), svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  root.append(svgText((L + W - R) / 2, H - 6, "round", { class: "label", "text-anchor": "middle" }));
  if (yLabel) root.append(svgText(12, (T + H - B) / 2, yLabel, { class: "label", "text-anchor": "middle", transform: `rotate(-90 12 ${(T + H - B) / 2})` }));
  if (best != null && best >= x0 && best <= x1) {
    root.append(svg("line", { x1: sx(best), x2: sx(best), y1: T, y2: H - B, class: "best" }));
    const right = sx(best) > W - R - 50;  // near the right edge: the label goes left of the line
    root.append(svgText(sx(best) + (right ? -3 : 3), T + 9, `best r${best}`, { class: "best-label", "text-anchor": right ? "end" : "start" }));
  }
  const barW = bars ? Math.max(2, (W - L - R) / (x1 - x0) * 0.7) : 0;
  for (const s of shown) {
    if (bars) {
      for (const [x, y, flag] of s.points) {
        const r = svg("rect", { x: sx(x) - barW / 2, y: sy(y), width: barW, height: Math.max(0.5, sy(y0) - sy(y)), fill: flag ? "#d62728" : s.color });
        const t = svg("title", {}); t.textContent = `round ${x}: ${fmtDur(y)}${flag ? " (" + flag + ")" : ""}`; r.append(t);
        root.append(r);
      }
      continue;
    }
    root.append(svg("polyline", { fill: "none", stroke: s.color, "stroke-width": s.width || 1.4,
      points: s.points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ") }));
    for (const [x, y] of s.points) {
      const c = svg("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: s.width > 2 ? 2.6 : 2, fill: s.color });
      const t = svg("title", {}); t.textContent = `${visible(s.name)}, round ${x}: ${fmtNum(y, 4)}`; c.append(t);
      root.append(c);
    }
  }
  // Hover: the round under the pointer, every shown series' value there.
  const guide = svg("line", { x1: 0, x2: 0, y1: T, y2: H - B, class: "guide hidden" });
  const hit = svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "hit" });
  root.append(guide, hit);
  const tip = el("div", { class: "tip hidden", role: "status" });
  const rounds = [...new Set(xs)].sort((a, b) => a - b);
  hit.addEventListener("pointermove", (ev) => {
    const box = root.getBoundingClientRect();
    const x = x0 + ((ev.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
    const round = rounds.reduce((a, b) => (Math.abs(b - x) < Math.abs(a - x) ? b : a));
    guide.setAttribute("x1", sx(round)); guide.setAttribute("x2", sx(round)); guide.classList.remove("hidden");
    const lines = [el("div", { class: "tip-head" }, `round ${round}`)];
    for (const s of shown) {
      const p = s.points.find((q) => q[0] === round);
      if (!p) continue;
      const sw = el("span", { class: "swatch" }); sw.style.backgroundColor = bars && p[2] ? "#d62728" : s.color;
      lines.push(el("div", {}, sw, party(s.name), ": " + (bars ? fmtDur(p[1]) + (p[2] ? ` (${p[2]})` : "") : fmtNum(p[1], 4))));
    }
    tip.replaceChildren(...lines);
    tip.classList.remove("hidden");
    const fx = ev.clientX - fig.getBoundingClientRect().left, fw = fig.getBoundingClientRect().width;
    tip.style.left = (fx > fw / 2 ? Math.max(0, fx - tip.offsetWidth - 12) : fx + 12) + "px";
    tip.style.top = (ev.clientY - fig.getBoundingClientRect().top + 12) + "px";
  });
  hit.addEventListener("pointerleave", () => { tip.classList.add("hidden"); guide.classList.add("hidden"); });
  fig.append(root, tip);
  return fig;
}

function legend(items, hidden, onToggle) {
  const box = el("div", { class: "legend", role: "group", "aria-label": "series shown" });
  for (const it of items) {
    const on = !hidden.has(it.name);
    const sw = el("span", { class: "swatch" }); sw.style.backgroundColor = it.color;
    const b = el("button", { type: "button", class: "series" + (on ? "" : " off"), "aria-pressed": String(on), "data-series": it.name, title: visible(it.name) }, sw, party(it.name));
    b.addEventListener("click", () => onToggle(it.name));
    box.append(b);
  }
  return box;
}
function siteColor(run) {
  const m = new Map();
  run.sites.forEach((s, i) => m.set(s.name, COLORS[i % COLORS.length]));
  return m;
}
function hiddenOf(key) { if (!ui.hidden.has(key)) ui.hidden.set(key, new Set()); return ui.hidden.get(key); }
function toggle(set, name) { if (set.has(name)) set.delete(name); else set.add(name); render(); }

function plots(run) {
  const names = new Set();
  for (const r of run.rounds) Object.keys(r.mean || {}).forEach((k) => names.add(k));
  const hidden = hiddenOf(run.key), colors = siteColor(run);
  const best = run.best_round ? run.best_round.round : null;
  const box = el("div", {});
  const items = [{ name: "mean", color: MEAN_COLOR }, ...run.sites.map((s) => ({ name: s.name, color: colors.get(s.name) }))];
  box.append(legend(items, hidden, (n) => toggle(hidden, n)));
  const grid = el("div", { class: "plots" });
  const ordered = [...names].sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a.localeCompare(b)));
  for (const metric of ordered.length ? ordered : ["loss"]) {
    const series = [{ name: "mean", color: MEAN_COLOR, width: 2.4, hidden: hidden.has("mean"),
      points: run.rounds.filter((r) => typeof r.mean[metric] === "number").map((r) => [r.round, r.mean[metric]]) }];
    for (const s of run.sites) {
      series.push({ name: s.name, color: colors.get(s.name), hidden: hidden.has(s.name),
        points: run.rounds.filter((r) => r.per_site[s.name] && typeof r.per_site[s.name][metric] === "number").map((r) => [r.round, r.per_site[s.name][metric]]) });
    }
    grid.append(chart({ title: `validation ${metric}` + (metric === run.selection_metric ? " (selection metric)" : ""), series, best, yLabel: metric, key: "val-" + metric }));
  }
  grid.append(chart({ title: "training loss (mean over the round's sites)", best, yLabel: "train loss", key: "train-loss",
    series: [{ name: "mean", color: MEAN_COLOR, width: 2.4, hidden: hidden.has("mean"),
      points: run.rounds.filter((r) => typeof r.train_loss === "number").map((r) => [r.round, r.train_loss]) }] }));
  grid.append(chart({ title: "round duration (red: closed without a site)", bars: true, best, yLabel: "seconds", key: "durations",
    series: [{ name: "duration", color: "#5a7bb5",
      points: run.rounds.filter((r) => typeof r.duration_s === "number").map((r) => [r.round, Math.max(0, r.duration_s),
        r.stragglers && r.stragglers.length ? "without " + r.stragglers.map(visible).join(", ") : ""]) }] }));
  box.append(grid);
  return box;
}

// -- timeline ----------------------------------------------------------------------------------------------
const KIND_TEXT = { run: "run", round: "round", deadline: "deadline", stall: "stall", offline: "offline", back: "back", site: "site",
  refused: "refused", invalid: "dropped", skipped: "skipped", note: "PS" };
function timeline(run) {
  const box = el("div", {});
  const kinds = [...new Set(run.eventList.map((e) => e.kind))];
  const filter = el("div", { class: "legend", role: "group", "aria-label": "event kinds shown" });
  for (const k of Object.keys(KIND_TEXT).filter((x) => kinds.includes(x))) {
    const on = !ui.hiddenKinds.has(k);
    const b = el("button", { type: "button", class: "series kind-" + word(k) + (on ? "" : " off"), "aria-pressed": String(on) }, KIND_TEXT[k]);
    b.addEventListener("click", () => toggle(ui.hiddenKinds, k));
    filter.append(b);
  }
  box.append(filter);
  if (run.timeline_note) box.append(el("p", { class: "muted" }, run.timeline_note));
  if (run.source === "live") {
    box.append(el("p", { class: "muted" }, "Refused messages: the PS counts them per sending site and reason category on ps/status; " +
      "the full reason of each is in the PS's log. Messages this page dropped itself are shown with their sender and reason."));
  }
  const events = run.eventList.filter((e) => !ui.hiddenKinds.has(e.kind)).slice(-EVENTS_SHOWN).reverse();
  const ol = el("ol", { class: "timeline", reversed: "" });
  for (const e of events) {
    ol.append(el("li", { "data-kind": word(e.kind) },
      el("time", {}, fmtClock(e.t)),
      el("span", { class: "kind kind-" + word(e.kind) }, KIND_TEXT[e.kind] || "event"),
      el("span", { class: "round" }, e.round != null ? "r" + e.round : ""),
      party(e.text + (e.deadline ? `; deadline ${fmtClock(e.deadline)}` : ""), "event-text")));
  }
  if (!events.length) box.append(el("p", { class: "muted" }, "nothing yet"));
  const older = run.eventList.length - events.length + (run.events_dropped || 0);
  box.append(ol);
  if (older > 0 && events.length === EVENTS_SHOWN) box.append(el("p", { class: "muted" }, `${older} older events not shown`));
  return box;
}

// -- sites -------------------------------------------------------------------------------------------------
function lastUpdate(run, site) {
  for (let i = run.rounds.length - 1; i >= 0; i--) {
    const m = run.rounds[i].per_site[site];
    if (m) return `r${run.rounds[i].round}: loss ${fmtNum(m.loss)}` + (m.auroc != null ? `, auroc ${fmtNum(m.auroc)}` : "");
  }
  return "–";
}
function dataCell(s, run) {
  if (!s.n_train && !s.n_val && !s.n_test) return "–";
  const parts = [el("span", { title: "training / validation / test rows" }, `${s.n_train} / ${s.n_val} / ${s.n_test}`)];
  const h = s.label_histogram;
  if (h && Object.keys(h).length) {
    const entries = Object.entries(h).sort((a, b) => a[0].localeCompare(b[0], undefined, { numeric: true }));
    const text = entries.slice(0, 6).map(([k, v]) => `${k}: ${v}`).join(", ") + (entries.length > 6 ? `, +${entries.length - 6} more` : "");
    parts.push(el("br"), el("span", { class: "muted" }, "labels "), party(text));
  }
  if (run.source === "report") parts.push(el("br"), el("span", { class: "muted" }, "train rows from its last round"));
  return el("span", {}, parts);
}
function usageCell(s) {
  const parts = [];
  if (Object.keys(s.usage || {}).length) {
    parts.push(`total CPU ${fmtSecs(s.usage.cpu_s)}` + (s.usage.energy_j ? `, GPU ${fmtNum(s.usage.energy_j, 0)} J` : ""));
  }
  if (s.last_compute && s.last_compute.wall_s != null) {
    parts.push(`last round ${fmtSecs(s.last_compute.wall_s)} (CPU ${fmtSecs(s.last_compute.cpu_s)}` +
      (s.last_compute.energy_j != null ? `, ${fmtNum(s.last_compute.energy_j, 0)} J)` : ")"));
  }
  if (s.last_update_bytes != null) parts.push(`update ${fmtBytes(s.last_update_bytes)}`);
  return parts.join("; ") || "–";
}
function epsilonCell(s) {
  const e = s.epsilon;
  if (!e) return "–";
  return el("span", { title: `record-level DP: what this site's training records have spent over all its rounds and runs, by its ${e.accountant} accountant (${e.steps} DP-SGD steps, noise multiplier ${fmtNum(e.noise_multiplier)})` },
    `ε ${fmtNum(e.epsilon)} at δ ${e.delta}`);
}
const SITE_COLUMNS = ["site", "state", "last seen", "rounds", "last update (val)", "data (train / val / test)", "refused by the PS", "usage", "privacy spent (ε)", "detail", "device"];
// On a phone each site is a card (style.css): every cell names its column (data-col).
function sitesTable(run, now) {
  const table = el("table", { class: "sites" });
  table.append(el("tr", {}, ...SITE_COLUMNS.map((h) => el("th", {}, h))));
  const droppedWhy = new Map((run.sites_dropped || []).map((d) => [d.site, d.why]));
  for (const s of run.sites) {
    const refused = Object.entries(s.rejected || {});
    const stateCell = el("span", { class: "state state-" + word(s.state) }, party(s.state));
    const refusedCell = refused.length ? el("span", { class: "list" }, refused.map(([k, v], i) => [i ? "; " : "", party(k), ` ×${v}`])) : "–";
    const cells = [party(s.name), droppedWhy.has(s.name) ? el("span", {}, stateCell, el("br"), el("span", { class: "dropped-why" }, el("span", { class: "muted" }, "dropped: "), party(droppedWhy.get(s.name)))) : stateCell,
      run.source === "live" ? fmtAgo(s.last_seen, now) : "–", String(s.rounds_participated), lastUpdate(run, s.name),
      dataCell(s, run), refusedCell, usageCell(s), epsilonCell(s), s.detail ? party(s.detail) : "", s.device ? party(s.device) : "–"];
    const classes = { 6: "rejected", 8: "epsilon", 9: "detail" };
    table.append(el("tr", { "data-site": s.name }, cells.map((c, i) => el("td", { "data-col": SITE_COLUMNS[i], class: classes[i] }, c))));
  }
  return scroller(table);
}

// -- one run -----------------------------------------------------------------------------------------------
function part(id, title, ...content) { return el("div", { class: "part", id }, el("h3", {}, title), ...content); }
function renderRun(run, now) {
  const sec = el("section", { class: "run", "data-run": run.run_id, "data-run-key": String(run.key) });
  const badgeClass = "badge badge-" + word(run.status);
  sec.append(el("h2", {}, "run ", party(run.run_id), run.source === "report" ? [" — ", party(run.label)] : [], " ",
    el("span", { class: badgeClass }, run.status)));
  const id = (p) => `run-${run.key}-${p}`;
  // What each reader looks for first: a finished run's results; a live run's sites and what just happened.
  const body = {
    results: () => (run.results ? resultsPanel(run) : liveResults(run)),
    plots: () => plots(run), timeline: () => timeline(run), sites: () => sitesTable(run, now),
    recruitment: () => el("pre", {}, visible(JSON.stringify(run.recruitment, null, 2))),
  };
  const titles = { results: "results", plots: "metrics per round", timeline: "timeline", sites: "sites", recruitment: "recruitment" };
  const order = (run.source === "report" ? ["results", "plots", "timeline", "sites"] : ["sites", "timeline", "results", "plots"])
    .filter((p) => p !== "results" || run.results || run.final);
  if (run.recruitment) order.push("recruitment");
  sec.append(el("nav", { class: "jump" }, ["overview", ...order].map((p) => el("a", { href: "#" + id(p) }, titles[p] || p))));
  sec.append(part(id("overview"), "overview", runFacts(run, now)));
  if (run.history_missing_before) {
    sec.append(el("p", { class: "warn history" }, `Rounds before ${run.history_missing_before} closed before this dashboard ` +
      "connected; the broker keeps only the last round's metrics, so their history is not available here " +
      "(open the finished run with --run for all rounds)."));
  }
  for (const p of order) sec.append(part(id(p), titles[p], body[p]()));
  return sec;
}

// -- several runs: the list and the comparison ---------------------------------------------------------------
function meanRow(run, model) {
  const m = run.results && run.results.models.find((x) => x.model === model);
  return m ? m.rows.find((r) => r.kind === "mean") : null;
}
function runList(runs) {
  const metrics = [...new Set(runs.flatMap((r) => (r.results ? r.results.metrics.slice(0, 2) : [])))];
  const table = el("table", { class: "runlist" });
  table.append(el("tr", {}, el("th", {}, "compare"), el("th", {}, "run"), el("th", {}, "run id"), el("th", {}, "algorithm"),
    el("th", {}, "rounds"), el("th", {}, "finished"), el("th", {}, "best round"), ...metrics.map((m) => el("th", { class: "num" }, "final test " + m))));
  for (const r of runs) {
    const box = el("input", { type: "checkbox", class: "compare", "aria-label": "compare " + visible(r.label) });
    box.checked = ui.compare.has(r.key);
    box.addEventListener("change", () => { if (box.checked) ui.compare.add(r.key); else ui.compare.delete(r.key); render(); });
    const open = el("button", { type: "button", class: "open" + (r.key === ui.selected ? " current" : "") }, party(r.label));
    open.addEventListener("click", () => { ui.selected = r.key; render(); });
    const mean = meanRow(r, "final");
    table.append(el("tr", { "data-key": String(r.key) }, el("td", {}, box), el("td", {}, open), el("td", {}, party(r.run_id)),
      el("td", {}, party(r.algorithm || "–")), el("td", {}, `${r.round} of ${r.rounds_total || "?"}`), el("td", {}, fmtWhen(r.finished_at)),
      el("td", {}, r.best_round ? `${r.best_round.round} (${visible(r.best_round.metric)})` : "–"),
      ...metrics.map((m) => el("td", { class: "num" }, mean && mean.cells[m] ? mean.cells[m].text : "–"))));
  }
  return el("section", { class: "runs-panel" }, el("h2", {}, `${runs.length} runs`),
    el("p", { class: "muted" }, "Open a run for its details; tick two or more to compare them."), scroller(table));
}
function compare(runs) {
  const chosen = runs.filter((r) => ui.compare.has(r.key));
  const sec = el("section", { class: "compare" }, el("h2", {}, `comparing ${chosen.length} runs`));
  if (chosen.length < 2) { sec.append(el("p", { class: "muted" }, "Tick two or more runs above to compare them.")); return sec; }
  const metrics = [...new Set(chosen.flatMap((r) => r.rounds.flatMap((x) => Object.keys(x.mean || {}))))].sort();
  const choices = [...metrics.map((m) => "val " + m), "train loss"];
  const selMetric = chosen[0].selection_metric ? "val " + chosen[0].selection_metric : choices[0];
  if (!choices.includes(ui.compareMetric)) ui.compareMetric = choices.includes(selMetric) ? selMetric : choices[0];
  const pick = el("div", { class: "legend", role: "group", "aria-label": "metric" });
  for (const c of choices) {
    const b = el("button", { type: "button", class: "choice" + (c === ui.compareMetric ? " chosen" : ""), "aria-pressed": String(c === ui.compareMetric) }, c);
    b.addEventListener("click", () => { ui.compareMetric = c; render(); });
    pick.append(b);
  }
  const metric = ui.compareMetric;
  const value = (x) => (metric === "train loss" ? x.train_loss : (x.mean || {})[metric.slice(4)]);
  const labels = new Map(chosen.map((r) => [r.key, visible(r.label)]));
  const series = chosen.map((r, i) => ({ name: labels.get(r.key), color: COLORS[i % COLORS.length], width: 2, hidden: ui.hiddenRuns.has(r.label),
    points: r.rounds.filter((x) => typeof value(x) === "number").map((x) => [x.round, value(x)]) }));
  sec.append(el("p", { class: "muted" }, "Mean over each run's sites, per round, on the same axes."), pick,
    legend(chosen.map((r, i) => ({ name: r.label, color: COLORS[i % COLORS.length] })), ui.hiddenRuns, (n) => toggle(ui.hiddenRuns, n)),
    el("div", { class: "plots wide" }, chart({ title: metric + " per round", series, yLabel: metric, key: "compare", wide: true })));
  const finalMetrics = [...new Set(chosen.flatMap((r) => (r.results ? r.results.metrics : [])))];
  const table = el("table", { class: "compare" });
  table.append(el("tr", {}, el("th", {}, "run"), el("th", {}, "algorithm"), el("th", {}, "rounds"), el("th", {}, "best round"), el("th", {}, "model"),
    ...finalMetrics.map((m) => el("th", { class: "num" }, "test " + m))));
  for (const r of chosen) {
    for (const model of ["final", "best"]) {
      const mean = meanRow(r, model);
      if (!mean) continue;
      table.append(el("tr", { "data-key": String(r.key), "data-model": model }, el("td", {}, party(r.label)), el("td", {}, party(r.algorithm || "–")),
        el("td", {}, String(r.rounds.length)), el("td", {}, r.best_round ? `${r.best_round.round} (${visible(r.best_round.metric)})` : "–"),
        el("td", {}, model === "final" ? "final, mean" : "best round, mean"),
        ...finalMetrics.map((m) => el("td", { class: "num", "data-metric": m }, mean.cells[m] ? mean.cells[m].text : "–"))));
    }
  }
  sec.append(el("h3", {}, "final metrics (test split, unweighted mean over sites)"), scroller(table));
  return sec;
}

// -- the page ----------------------------------------------------------------------------------------------
function overallStatus(runs) {
  const kinds = [...new Set(runs.map((r) => r.status))];
  return kinds.length === 1 ? kinds[0] : "mixed";
}
function render() {
  const runs = [...store.runs.values()].sort((a, b) => a.key - b.key);
  const main = document.getElementById("runs");
  if (ui.compare === null && runs.length) ui.compare = new Set(runs.length <= 8 ? runs.map((r) => r.key) : []);
  if (!runs.some((r) => r.key === ui.selected) && runs.length) ui.selected = runs[0].key;
  const out = [];
  if (runs.length > 1) out.push(runList(runs), compare(runs));
  const run = runs.find((r) => r.key === ui.selected);
  if (run) out.push(renderRun(run, store.now));
  main.replaceChildren(...out);
  document.getElementById("note").textContent = visible(store.note);
  const status = overallStatus(runs);
  const badge = document.getElementById("status");
  badge.textContent = status;
  badge.className = "badge badge-" + word(status);
  document.body.setAttribute("data-updated", String(store.now));
}

function connect() {
  const source = new EventSource("/events");
  const conn = document.getElementById("conn");
  // #conn is about this page's link to the dashboard server only; whether the run is live is #status.
  source.onopen = () => { conn.textContent = "connected"; };
  source.onmessage = (ev) => { merge(JSON.parse(ev.data)); render(); conn.textContent = "updated " + new Date().toLocaleTimeString(); };
  source.onerror = () => { conn.textContent = "dashboard server unreachable: retrying"; };
}
document.addEventListener("DOMContentLoaded", connect);
