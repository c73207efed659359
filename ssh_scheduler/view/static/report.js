// ssh_scheduler report: draws the batch from the JSON block #data (view/report_data.py).
// Every text from a job, a host or a file is set with textContent, never parsed as markup.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const A = D.attempts, S = D.summary, OUT = D.outcomes;
  const LABEL = { finished: "finished", failed: "failed", timed_out: "killed by timeout", requeued: "requeued (host lost)",
    cancelled: "cancelled", running: "running", unknown: "no end recorded" };
  let view = [0, Math.max(D.span, 1e-3)];

  function h(tag, cls, text, parent) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (parent) parent.appendChild(e);
    return e;
  }
  function svg(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function dur(s) {
    if (s === null || s === undefined) return "-";
    if (s < 10) return s.toFixed(1) + " s";
    s = Math.round(s);
    const hh = Math.floor(s / 3600), mm = Math.floor(s % 3600 / 60), ss = s % 60;
    return hh ? hh + "h" + String(mm).padStart(2, "0") + "m" : mm ? mm + "m" + String(ss).padStart(2, "0") + "s" : ss + " s";
  }
  function clock(rel) { return new Date((D.t0 + rel) * 1000).toLocaleString(); }
  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const u = ["bytes", "KB", "MB", "GB", "TB"];
    let i = 0, v = n;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v) + " " + u[i];
  }
  function pct(f) { return Math.round(f * 100) + "%"; }
  function width() { return Math.max(760, document.documentElement.clientWidth - 48); }

  // --- header and summary -------------------------------------------------------------------
  document.getElementById("title").textContent = "Batch report: " + D.title;
  const state = { running: "running: a snapshot taken " + clock(D.span), finished: "finished",
    stopped: "stopped: its coordinator ended without finishing it (the same execute_batch again goes on with it)" }[D.state];
  document.getElementById("state").textContent = state + " \u00b7 started " + clock(0) + " \u00b7 " + D.resultsDir +
    (D.fromEvents ? "" : " \u00b7 from the journal alone (no GPU readings)");

  function card(parent, label, value, cls) {
    const c = h("div", "card" + (cls ? " " + cls : ""), null, parent);
    h("div", "value", value, c);
    h("div", "label", label, c);
  }
  function table(parent, head, rows, cls) {
    const t = h("table", cls || "", null, parent), tr = h("tr", "", null, h("thead", "", null, t));
    head.forEach(x => h("th", "", x, tr));
    const body = h("tbody", "", null, t);
    rows.forEach(r => { const row = h("tr", "", null, body); r.forEach(x => (x instanceof Node ? h("td", "", null, row).appendChild(x) : h("td", "", x, row))); });
    return t;
  }
  (function summary() {
    const sec = document.getElementById("summary"), cards = h("div", "cards", null, sec);
    const j = S.jobsByOutcome;
    card(cards, "jobs", S.jobs === null ? S.jobsSeen : S.jobs);
    card(cards, "finished", j.finished, "o-finished");
    card(cards, "failed", j.failed, j.failed ? "o-failed" : "");
    card(cards, "killed by timeout", j.timed_out, j.timed_out ? "o-timed_out" : "");
    if (j.running) card(cards, "running", j.running, "o-running");
    if (j.cancelled + S.cancelledQueued) card(cards, "cancelled", j.cancelled + S.cancelledQueued, "o-cancelled");
    if (j.unknown) card(cards, "no end recorded", j.unknown, "o-unknown");
    card(cards, "requeued attempts", S.attemptsByOutcome.requeued, S.attemptsByOutcome.requeued ? "o-requeued" : "");
    if (S.retried) card(cards, "retried attempts", S.retried);
    if (S.notRunCount) card(cards, "not run", S.notRunCount);
    if (S.skipped) card(cards, "skipped (results exist)", S.skipped);
    card(cards, "wall time", dur(S.wall) + (S.ended ? "" : " so far"));
    card(cards, "sent", S.bytesSent === null ? "-" : bytes(S.bytesSent) + " in " + S.filesSent + " files");
    card(cards, "received", bytes(S.bytesReceived));
    if (S.exitLines.length) h("pre", "exit", S.exitLines.join("\n"), sec);
    const cols = h("div", "columns", null, sec), left = h("div", "", null, cols), right = h("div", "", null, cols);
    h("h3", "", "Busy (a job of ours on it) over the wall time", left);
    table(left, ["lane", "busy"], S.busy.map(b => {
      const m = h("span", "meter"), fill = h("span", "fill", null, m);
      fill.style.width = pct(b.fraction);
      const cell = h("span"); cell.appendChild(m); h("span", "", " " + pct(b.fraction), cell);
      return [b.lane, cell];
    }), "busy");
    h("h3", "", "Slowest jobs", right);
    table(right, ["job", "where", "took", "how it ended"], S.slowest.map(i =>
      [A.job[i], A.host[i] + (A.gpus[i] ? " GPU " + A.gpus[i] : ""), dur(A.end[i] - A.start[i]), LABEL[OUT[A.outcome[i]]]]), "slowest");
  })();

  // --- details of one attempt ---------------------------------------------------------------
  function describe(i, into) {
    const o = OUT[A.outcome[i]];
    const dl = h("dl", "", null, into);
    const add = (k, v) => { if (v !== null && v !== undefined && v !== "") { h("dt", "", k, dl); h("dd", "", v, dl); } };
    add("job", A.job[i]);
    add("ended", LABEL[o] + (A.reason[i] && o !== "finished" ? ": " + A.reason[i] : ""));
    add("exit status", A.code[i]);
    add("where", A.host[i] + (A.gpus[i] ? ", GPU " + A.gpus[i] : "") + (A.slurm[i] ? ", Slurm job " + A.slurm[i] : ""));
    if (A.mem[i]) add("reserved", A.mem[i] + " MiB on each GPU");
    add("ran", clock(A.start[i]) + " for " + dur(A.end[i] - A.start[i]));
    if (A.bytes[i]) add("received", bytes(A.bytes[i]));
    const files = [A.out[i] ? D.resultsDir + "/" + A.job[i] + ".out" : "", A.err[i] ? D.resultsDir + "/" + A.job[i] + ".err" : ""];
    add("output", files.filter(Boolean).join("  ") || "none written");
    h("dt", "", "command", dl);
    h("pre", "command", A.command[i], h("dd", "", null, dl));
    return dl;
  }

  // --- the timeline -------------------------------------------------------------------------
  const COLOR = { finished: "#3a9d5d", failed: "#d64545", timed_out: "#e8912d", requeued: "#8e6bbf",
    cancelled: "#9a9a9a", running: "#3b82c4", unknown: "#c8c8c8" };
  const L = 170, AXIS = 26;
  (function legend() {
    const box = document.getElementById("legend");
    OUT.forEach(o => {
      const n = S.attemptsByOutcome[o];
      if (!n && o !== "finished" && o !== "failed") return;
      const item = h("span", "key", null, box), sw = h("span", "swatch", null, item);
      sw.style.background = COLOR[o];
      h("span", "", LABEL[o] + " (" + n + ")", item);
    });
  })();
  function rowHeight(rows) { return rows <= 4 ? 14 : Math.max(1, Math.floor(64 / rows)); }
  function ticks(v0, v1, px) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400];
    const want = (v1 - v0) / Math.max(2, px / 110);
    let step = steps.find(s => s >= want) || 86400 * Math.ceil(want / 86400);
    if (want < 1) step = Math.pow(10, Math.ceil(Math.log10(want)));
    const out = [];
    for (let t = Math.ceil(v0 / step) * step; t <= v1; t += step) out.push(t);
    return out;
  }
  function axis(g, x, v0, v1, top, bottom, px) {
    ticks(v0, v1, px).forEach(t => {
      svg("line", { x1: x(t), x2: x(t), y1: top, y2: bottom, class: "grid" }, g);
      svg("text", { x: x(t) + 2, y: top - 6, class: "tick" }, g).textContent = "+" + dur(t);
    });
  }
  const tip = document.getElementById("tip");
  function showTip(ev, lines) {
    tip.replaceChildren();
    lines.forEach((l, k) => h(k ? "div" : "strong", "", l, tip));
    tip.hidden = false;
    tip.style.left = Math.min(ev.pageX + 14, document.documentElement.scrollWidth - 380) + "px";
    tip.style.top = ev.pageY + 14 + "px";
  }
  function drawTimeline() {
    const box = document.getElementById("bars"), W = width(), P = W - L - 12;
    const [v0, v1] = view;
    const x = t => L + (t - v0) / (v1 - v0) * P;
    let y = AXIS;
    const tops = D.lanes.map(l => { const top = y; y += l.rows * rowHeight(l.rows) + 6; return top; });
    const root = svg("svg", { width: W, height: y + 4, class: "timeline" });
    axis(root, x, v0, v1, AXIS, y, P);
    D.lanes.forEach((l, i) => {
      const g = svg("g", { class: "lane", "data-lane": l.name }, root);
      svg("rect", { x: 0, y: tops[i], width: W, height: l.rows * rowHeight(l.rows) + 6, class: i % 2 ? "band odd" : "band" }, g);
      svg("text", { x: 6, y: tops[i] + 14, class: "lane-label" }, g).textContent = l.name;
    });
    const layer = svg("g", { class: "bars" }, root);
    let prev = null;
    D.bars.forEach(b => {
      const [lane, row, s, e, i] = b;
      if (e < v0 || s > v1) return;
      const rh = rowHeight(D.lanes[lane].rows), x0 = Math.max(x(s), L), x1 = Math.min(x(e), L + P), o = OUT[A.outcome[i]];
      const top = tops[lane] + 3 + row * rh;
      if (x1 - x0 < 2 && prev && prev.lane === lane && prev.row === row && prev.o === o && x0 - prev.x1 < 1) {
        prev.x1 = Math.max(prev.x1, x1, x0 + 1);
        prev.n++;
        prev.el.setAttribute("width", prev.x1 - prev.x0);
        prev.el.setAttribute("data-n", prev.n);
        return;
      }
      const el = svg("rect", { x: x0, y: top, width: Math.max(x1 - x0, 1), height: Math.max(rh - (rh > 3 ? 2 : 0), 1),
        fill: COLOR[o], class: "bar o-" + o, "data-a": i, "data-l": lane, "data-n": 1 }, layer);
      prev = { lane, row, o, x0, x1: Math.max(x1, x0 + 1), n: 1, el };
    });
    D.hostChanges.forEach((c, k) => {
      if (c[0] < v0 || c[0] > v1) return;
      D.lanes.forEach((l, i) => {
        if (l.host !== c[1]) return;
        svg("line", { x1: x(c[0]), x2: x(c[0]), y1: tops[i], y2: tops[i] + l.rows * rowHeight(l.rows) + 6,
          class: "hc hc-" + c[2], "data-change": k }, root);
      });
    });
    const pick = svg("rect", { x: L, y: AXIS - 4, width: 0, height: y - AXIS, class: "pick" }, root);
    let from = null;
    root.addEventListener("mousedown", ev => { if (ev.offsetX > L) { from = ev.offsetX; ev.preventDefault(); } });
    root.addEventListener("mousemove", ev => {
      if (from !== null) { pick.setAttribute("x", Math.min(from, ev.offsetX)); pick.setAttribute("width", Math.abs(ev.offsetX - from)); }
      const bar = ev.target.closest("rect.bar"), line = ev.target.closest("line.hc");
      if (bar) {
        const i = +bar.dataset.a, n = +bar.dataset.n;
        if (n > 1) return showTip(ev, [n + " attempts, " + LABEL[OUT[A.outcome[i]]], "drag across them to zoom in"]);
        showTip(ev, [A.job[i], LABEL[OUT[A.outcome[i]]] + (A.reason[i] && A.outcome[i] ? ": " + A.reason[i] : ""),
          A.host[i] + (A.gpus[i] ? " GPU " + A.gpus[i] : "") + ", " + dur(A.end[i] - A.start[i]), A.command[i].slice(0, 200)]);
      } else if (line) {
        const c = D.hostChanges[+line.dataset.change];
        showTip(ev, [c[1] + ": " + c[2], clock(c[0]), c[3]]);
      } else tip.hidden = true;
    });
    root.addEventListener("mouseleave", () => { tip.hidden = true; });
    root.addEventListener("mouseup", ev => {
      if (from === null) return;
      const a = Math.min(from, ev.offsetX), b = Math.max(from, ev.offsetX);
      from = null;
      pick.setAttribute("width", 0);
      if (b - a > 5) { view = [v0 + (a - L) / P * (v1 - v0), v0 + (b - L) / P * (v1 - v0)]; drawAll(); }
    });
    root.addEventListener("click", ev => {
      const bar = ev.target.closest("rect.bar");
      if (!bar || +bar.dataset.n > 1) return;
      const panel = document.getElementById("details");
      panel.replaceChildren();
      h("h3", "", "Attempt", panel);
      describe(+bar.dataset.a, panel);
    });
    box.replaceChildren(root);
    document.getElementById("window").textContent = " showing +" + dur(v0) + " to +" + dur(v1) + " of " + dur(D.span);
  }
  document.getElementById("reset").addEventListener("click", () => { view = [0, Math.max(D.span, 1e-3)]; drawAll(); });

  // --- GPUs ---------------------------------------------------------------------------------
  function steps(ts, vs, x, y, v1) {
    let d = "";
    ts.forEach((t, k) => { d += (k ? "H" + x(t) + "V" : "M" + x(t) + ",") + y(vs[k]); });
    return ts.length ? d + "H" + x(v1) : "";
  }
  function drawGpus() {
    const box = document.getElementById("gpu-charts"), W = width(), P = W - L - 12, H = 92;
    const [v0, v1] = view, x = t => L + (Math.min(Math.max(t, v0), v1) - v0) / (v1 - v0) * P;
    box.replaceChildren();
    if (!D.gpus.length) { h("p", "hint", D.fromEvents ? "No GPUs were probed." : "No GPU readings: they are in the event file, which this run did not leave.", box); return; }
    D.gpus.forEach(g => {
      const top = [g.total, g.peak].concat(g.used, g.reserved.map(r => r[1])).reduce((a, b) => Math.max(a, b), 0) || 1;
      const y = mb => 18 + H - mb / top * H, yu = u => 18 + H - u / 100 * H;
      const root = svg("svg", { width: W, height: H + 30, class: "gpu", "data-gpu": g.host + " GPU " + g.index }, box);
      const label = svg("text", { x: 6, y: 14, class: "lane-label" }, root);
      label.textContent = g.host + " GPU " + g.index + (g.total ? " \u00b7 " + g.total + " MiB" : "") +
        " \u00b7 peak reserved + others' " + g.peak + " MiB" + (g.over ? " \u00b7 OVER-COMMITTED" : "") +
        (g.idleHeld !== null ? " \u00b7 idle " + pct(g.idleHeld) + " of the probes while we held it" : "");
      if (g.over) label.setAttribute("class", "lane-label over");
      const stop = g.until === null ? v1 : Math.min(g.until, v1);  // a lost host's last reading ends with it
      const area = (lo, hi) => { if (!g.t.length) return ""; let d = "M" + x(g.t[0]) + "," + y(lo[0]);
        g.t.forEach((t, k) => { d += "H" + x(t) + "V" + y(hi[k]); }); d += "H" + x(stop);
        for (let k = g.t.length - 1; k >= 0; k--) d += "V" + y(lo[k]) + "H" + x(g.t[k]); return d + "Z"; };
      svg("path", { d: area(g.t.map(() => 0), g.ours), class: "ours" }, root);
      svg("path", { d: area(g.ours, g.used), class: "others" }, root);
      if (g.total) svg("line", { x1: L, x2: L + P, y1: y(g.total), y2: y(g.total), class: "size" }, root);
      svg("path", { d: steps(g.t, g.util, x, yu, stop), class: "util" }, root);
      svg("path", { d: steps(g.reserved.map(r => r[0]), g.reserved.map(r => r[1]), x, y, v1), class: "reserved" }, root);
      svg("text", { x: 6, y: 34, class: "axis-note" }, root).textContent = top + " MiB";
      svg("text", { x: 6, y: 18 + H, class: "axis-note" }, root).textContent = "0";
    });
    const key = h("p", "gpu-key", null, box);
    [["ours", "our jobs' memory"], ["others", "others' memory"], ["reserved", "reserved by our jobs"], ["util", "utilization (0-100%)"], ["size", "the card's size"]]
      .forEach(([c, t]) => { const s = h("span", "key", null, key); h("span", "swatch k-" + c, null, s); h("span", "", t, s); });
  }

  // --- failures -----------------------------------------------------------------------------
  (function failures() {
    const sec = document.getElementById("failures");
    if (!S.failures.length && !S.notRun.length) { h("p", "hint", "No job failed.", sec); return; }
    if (S.failedCount > S.failures.length) h("p", "hint", S.failedCount + " jobs failed; the first " + S.failures.length + " are shown.", sec);
    S.failures.forEach(f => {
      const box = h("div", "failure", null, sec);
      box.dataset.job = A.job[f.attempt];
      h("h3", "", A.job[f.attempt], box);
      describe(f.attempt, box);
      if (f.err !== null) { h("div", "err-label", "first lines of its .err", box); h("pre", "err", f.err, box); }
    });
    if (S.notRun.length) {
      h("h3", "", "Not run", sec);
      table(sec, ["job", "why"], S.notRun);
    }
  })();

  // --- a sweep ------------------------------------------------------------------------------
  (function sweep() {
    const sec = document.getElementById("sweep");
    if (!D.sweep) { sec.hidden = true; return; }
    const fmt = v => (v === null ? "" : typeof v === "number" ? +v.toPrecision(6) : String(v));
    table(sec, D.sweep.columns, D.sweep.rows.map(r => r.map(fmt)), "results");
    const grid = h("div", "plots", null, sec);
    D.sweep.plots.forEach(p => {
      const W = 320, H = 220, l = 52, b = 36, fig = h("figure", "plot", null, grid);
      const root = svg("svg", { width: W, height: H }, fig);
      h("figcaption", "", p.metric + " against " + p.param, fig);
      const xs = p.points.map(q => q[0]), ys = p.points.map(q => q[1]);
      const cats = p.numeric ? null : [...new Set(xs.map(String))];
      const fx = p.numeric ? (p.log ? Math.log10 : v => v) : v => cats.indexOf(String(v));
      const xv = xs.map(fx), x0 = Math.min(...xv), x1 = Math.max(...xv), y0 = Math.min(...ys), y1 = Math.max(...ys);
      const X = v => l + 8 + (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5) * (W - l - 20);
      const Y = v => H - b - 8 - (y1 > y0 ? (v - y0) / (y1 - y0) : 0.5) * (H - b - 24);
      svg("line", { x1: l, x2: W - 4, y1: H - b, y2: H - b, class: "frame" }, root);
      svg("line", { x1: l, x2: l, y1: 8, y2: H - b, class: "frame" }, root);
      svg("text", { x: 4, y: 16, class: "tick" }, root).textContent = fmt(y1);
      svg("text", { x: 4, y: H - b - 4, class: "tick" }, root).textContent = fmt(y0);
      const xl = p.numeric ? [x0, x1].map(v => fmt(p.log ? Math.pow(10, v) : v)) : [cats[0], cats[cats.length - 1]];
      svg("text", { x: l, y: H - b + 16, class: "tick" }, root).textContent = xl[0];
      svg("text", { x: W - 6, y: H - b + 16, class: "tick end" }, root).textContent = xl[1];
      svg("text", { x: (W + l) / 2, y: H - 4, class: "tick middle" }, root).textContent = p.param + (p.log ? " (log)" : "");
      p.points.forEach((q, k) => {
        const dot = svg("circle", { cx: X(xv[k]), cy: Y(q[1]), r: 4, class: "dot" }, root);
        svg("title", {}, dot).textContent = q[2] + ": " + p.param + " " + fmt(q[0]) + ", " + p.metric + " " + fmt(q[1]);
      });
    });
  })();

  function drawAll() { drawTimeline(); drawGpus(); }
  drawAll();
  let pending = null;
  window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(drawAll, 150); });
  document.body.dataset.drawn = "yes";
})();
