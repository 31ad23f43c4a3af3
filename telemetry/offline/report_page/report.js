// Draws the precision report's page from the JSON in #report-data (written by html_report.py).
// Every plot is an SVG drawn here, so the file needs no network and no library.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const RANK_COLORS = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#2ca02c"];
  const W = 460, H = 210, M = { left: 58, right: 12, top: 10, bottom: 26 };

  function el(tag, attrs, parent, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function svg(tag, attrs, parent, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(v) {
    if (typeof v === "string") return v;
    if (v === null || v === undefined) return "-";
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e4 || a < 1e-3) {
      const exact = Math.abs(Math.log10(a) - Math.round(Math.log10(a))) < 1e-9;
      return v.toExponential(exact ? 0 : 2).replace("e+", "e");
    }
    return String(+v.toPrecision(3));
  }
  function badge(severity, parent) {
    return el("span", { class: "badge " + severity }, parent, severity);
  }

  // -- Summary and findings ---------------------------------------------------------------
  function summary() {
    const head = document.getElementById("summary");
    const h1 = el("h1", {}, head, "precision report ");
    badge(data.verdict, h1);
    const ranks = data.ranks.join(", ") + (data.world_size ? " of " + data.world_size : "");
    el("div", { class: "meta" }, head,
      data.source + " \u2014 ranks " + ranks + ", " + data.steps + " optimizer steps, diagnostics on " +
      data.diagnosed_steps + " (first step in these files: " + data.first_step + ")");
    const list = document.getElementById("findings");
    if (!data.findings.length) el("li", {}, list, "healthy: no threshold crossed");
    for (const f of data.findings) {
      const li = el("li", { class: "finding", "data-check": f.check }, list);
      badge(f.severity, li);
      el("strong", {}, li, " " + f.finding);
      el("span", {}, li, " (first at step " + f.first_step + ")" + (f.alert ? " [alert " + f.alert + "]" : ""));
      el("div", { class: "advice" }, li, f.advice);
      if (f.details && f.details.length) {
        const ul = el("ul", { class: "details" }, li);
        for (const line of f.details) el("li", {}, ul, line);
      }
    }
  }

  // -- Plots --------------------------------------------------------------------------------
  function finite(points) {
    return points.filter((p) => typeof p[1] === "number").map((p) => p[1]);
  }
  // A linear axis with ticks at 1, 2 or 5 times a power of ten; a log axis (ticks at powers of
  // ten) when the positive values span more than three decades, zeros drawn on the bottom edge.
  function yScale(s) {
    const data = [];
    for (const pts of lines(s)) data.push(...finite(pts[1]));
    const all = data.slice();
    for (const t of s.thresholds) {
      const v = t.above !== null ? t.above : t.at_most;
      if (v !== null && v !== undefined) all.push(v);
    }
    const positive = all.filter((v) => v > 0);
    const log = positive.length > 0 && data.every((v) => v >= 0) &&
      Math.max(...positive) / Math.min(...positive) > 1e3;
    let lo, hi;
    const ticks = [];
    if (log) {
      lo = Math.floor(Math.log10(Math.min(...positive)));
      hi = Math.ceil(Math.log10(Math.max(...positive)));
      if (hi === lo) hi = lo + 1;
      const zero = data.some((v) => v === 0);
      if (zero) lo -= 1;  // a decade below the smallest positive value holds the zeros
      const every = Math.ceil((hi - lo) / 6);
      for (let e = lo; e <= hi; e += every) ticks.push(zero && e === lo ? 0 : Math.pow(10, e));
    } else {
      lo = Math.min(0, ...all);
      hi = Math.max(0, ...all);
      if (hi === lo) hi = lo + 1;
      const raw = (hi - lo) / 4, power = Math.pow(10, Math.floor(Math.log10(raw)));
      const step = [1, 2, 5, 10].map((m) => m * power).find((v) => v >= raw);
      lo = Math.floor(lo / step) * step;
      hi = Math.ceil(hi / step) * step;
      for (let v = lo; v <= hi + step / 2; v += step) ticks.push(+v.toPrecision(12));
    }
    const map = (v) => {
      const t = log ? (v > 0 ? Math.max(lo, Math.log10(v)) : lo) : v;
      return M.top + (H - M.top - M.bottom) * (1 - (t - lo) / (hi - lo));
    };
    return { map, ticks, log };
  }
  function lines(s) {
    if (s.ranks) return Object.entries(s.ranks).map(([r, pts]) => ["rank " + r, pts]);
    return [["all ranks", s.points]];
  }
  function plot(s, xmin, xmax, grid) {
    const fig = el("figure", { class: "plot", "data-series": s.key }, grid);
    const cap = el("figcaption", {}, fig, s.label + " ");
    el("span", { class: "key" }, cap, s.key);
    const root = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": s.label }, fig);
    const x = (step) => M.left + ((W - M.left - M.right) * (step - xmin)) / Math.max(1, xmax - xmin);
    const y = yScale(s);
    for (const t of y.ticks) {
      const py = y.map(t);
      svg("line", { class: "gridline", x1: M.left, x2: W - M.right, y1: py, y2: py }, root);
      svg("text", { x: M.left - 4, y: py + 3, "text-anchor": "end" }, root, fmt(t));
    }
    svg("line", { class: "axis", x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom }, root);
    svg("line", { class: "axis", x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom }, root);
    const xticks = Math.min(6, xmax - xmin + 1);
    for (let i = 0; i < xticks; i++) {
      const step = Math.round(xmin + ((xmax - xmin) * i) / Math.max(1, xticks - 1));
      svg("text", { x: x(step), y: H - M.bottom + 14, "text-anchor": "middle" }, root, String(step));
    }
    svg("text", { x: W - M.right, y: H - 2, "text-anchor": "end" }, root, "step");
    for (const t of s.thresholds) {
      const v = t.above !== null ? t.above : t.at_most;
      if (v === null || v === undefined) continue;
      const py = y.map(v);
      const line = svg("line", { class: "threshold " + t.severity, x1: M.left, x2: W - M.right, y1: py, y2: py }, root);
      svg("title", {}, line, t.check + ": " + t.severity + (t.above !== null ? " above " : " at most ") + fmt(v));
    }
    markers(root, x, s);
    lines(s).forEach(([name, pts], i) => {
      const color = s.ranks ? RANK_COLORS[i % RANK_COLORS.length] : "var(--line)";
      const finitePts = pts.filter((p) => typeof p[1] === "number");
      if (!s.scatter && finitePts.length > 1) {
        svg("polyline", {
          class: "series", stroke: color, "data-line": name,
          points: finitePts.map((p) => x(p[0]).toFixed(1) + "," + y.map(p[1]).toFixed(1)).join(" "),
        }, root);
      }
      for (const p of pts) {
        if (typeof p[1] === "number") {
          const dot = svg("circle", { class: "point", cx: x(p[0]), cy: y.map(p[1]), r: 2.5, fill: color }, root);
          svg("title", {}, dot, name + ", step " + p[0] + ": " + fmt(p[1]));
        } else {
          const cx = x(p[0]), cy = M.top + 6;
          const g = svg("g", { class: "point-nonfinite" }, root);
          svg("line", { x1: cx - 4, x2: cx + 4, y1: cy - 4, y2: cy + 4 }, g);
          svg("line", { x1: cx - 4, x2: cx + 4, y1: cy + 4, y2: cy - 4 }, g);
          svg("title", {}, g, name + ", step " + p[0] + ": " + p[1]);
        }
      }
    });
    if (s.ranks) {
      const legend = el("div", { class: "legend" }, fig);
      lines(s).forEach(([name], i) => {
        const span = el("span", {}, legend);
        el("i", { style: "border-color:" + RANK_COLORS[i % RANK_COLORS.length] }, span);
        span.appendChild(document.createTextNode(name));
      });
    }
    fig.setAttribute("data-rendered", String(root.querySelectorAll(".point, .point-nonfinite").length));
  }
  function markers(root, x, s) {
    const m = data.markers;
    const vline = (step, cls, title) => {
      const line = svg("line", { class: cls, x1: x(step), x2: x(step), y1: M.top, y2: H - M.bottom }, root);
      svg("title", {}, line, title);
    };
    for (const step of m.escalations) {
      vline(step, "marker-escalation", "escalated: step " + step + " diagnosed in full");
      // A triangle under the axis too: the origin's line often stands on the same step.
      const cx = x(step), cy = H - M.bottom + 1;
      const tri = svg("polygon", { class: "marker-escalation-tip", points: [cx, cy, cx - 4, cy + 7, cx + 4, cy + 7].join(" ") }, root);
      svg("title", {}, tri, "escalated: step " + step);
    }
    for (const step of m.failed) vline(step, "marker-failed", "step " + step + " raised");
    if (m.origin) vline(m.origin.step, "marker-origin", "step " + m.origin.step + ": " + m.origin.text);
  }
  function plots() {
    const grid = document.getElementById("plots");
    const steps = [data.first_step, data.steps];
    for (const s of data.series) for (const p of s.points) steps.push(p[0]);
    const xmin = Math.min(...steps), xmax = Math.max(...steps);
    for (const s of data.series) plot(s, xmin, xmax, grid);
    if (!data.series.length) el("p", {}, grid, "no precision diagnostics in these traces");
    const legend = document.getElementById("legend");
    const item = (cls, text) => {
      const span = el("span", {}, legend);
      el("i", { class: cls }, span);
      span.appendChild(document.createTextNode(text));
    };
    if (data.markers.origin) item("legend-origin", "red: step " + data.markers.origin.step + ", where the first NaN/Inf began");
    if (data.markers.escalations.length) item("legend-escalation", "orange dashes: escalated iterations");
    if (data.markers.failed.length) item("legend-failed", "dark red dots: steps that raised");
    item("legend-threshold", "dashed horizontal: a threshold (warning amber, problem red); \u00d7 at the top: NaN/Inf");
  }

  // -- Tables -------------------------------------------------------------------------------
  function table(parent, caption, columns, rows) {
    if (!rows.length) return;
    el("h3", {}, parent, caption);
    const t = el("table", {}, el("div", { class: "scroll" }, parent));
    const head = el("tr", {}, el("thead", {}, t));
    for (const [title] of columns) el("th", {}, head, title);
    const body = el("tbody", {}, t);
    for (const row of rows) {
      const tr = el("tr", {}, body);
      for (const [, get, cls] of columns) el("td", cls ? { class: cls } : {}, tr, fmt(get(row)));
    }
  }
  function tables() {
    const ranges = document.getElementById("ranges");
    const keys = data.series.filter((s) => s.key in (data.lines[0] || { values: {} }).values).map((s) => s.key);
    table(ranges, "The worst value of each diagnostic over each range of steps (over all ranks)", [
      ["steps", (l) => l.first + "-" + l.last],
      ...keys.map((k) => [k.replace("fsdp.precision.", ""), (l) => l.values[k]]),
      ["failed", (l) => l.failed],
      ["verdict", (l) => l.verdict + (l.findings.length ? ": " + l.findings.join(", ") : ""), "text"],
    ], data.lines);
    const audits = document.getElementById("audits");
    table(audits, "Operations the audit named", [
      ["step", (o) => o.step], ["kind", (o) => o.kind, "text"], ["operation", (o) => o.op, "text"],
      ["dtype", (o) => o.dtype, "text"], ["module", (o) => o.module, "text"], ["site", (o) => o.site, "text"],
      ["share", (o) => o.share], ["fix", (o) => o.fix, "text"],
    ], data.ops);
    table(audits, "Units forecast to reach their dtype's largest value", [
      ["unit", (f) => f.unit, "text"], ["dtype", (f) => f.dtype, "text"], ["step", (f) => f.step],
      ["amax", (f) => f.amax], ["limit", (f) => f.limit], ["steps left", (f) => f.steps_left],
    ], data.headroom_forecasts);
    const shadow = data.shadow.slice().sort((a, b) => (+b.cost || Infinity) - (+a.cost || Infinity)).slice(0, 20);
    table(audits, "The float32 shadow: modules where low precision costs most", [
      ["step", (m) => m.step], ["module", (m) => m.module, "text"], ["type", (m) => m.module_type, "text"],
      ["dtype", (m) => m.dtype, "text"], ["error / rounding", (m) => m.cost], ["from weights", (m) => m.weight_error],
      ["|max| / dtype max", (m) => m.headroom], ["below normal", (m) => m.underflow],
    ], shadow);
    const trend = (c) => c.scale_trend.length > 1
      ? c.scale_trend[0][1] + " (step " + c.scale_trend[0][0] + ") to " + c.scale_trend[c.scale_trend.length - 1][1]
        + " (step " + c.scale_trend[c.scale_trend.length - 1][0] + ")"
      : "";
    table(audits, "Float8 casts: what each float8 module's casts kept, at the last diagnosed step", [
      ["module", (c) => c.module, "text"], ["cast", (c) => c.role, "text"], ["dtype", (c) => c.dtype, "text"],
      ["scaling", (c) => c.granularity, "text"], ["amax", (c) => c.amax], ["scale", (c) => c.scale],
      ["flushed", (c) => c.flushed], ["subnormal", (c) => c.subnormal], ["saturated", (c) => c.saturated],
      ["SQNR dB", (c) => c.sqnr], ["NaN/Inf made", (c) => c.nonfinite], ["scale over the run", trend, "text"],
    ], data.float8 || []);
    if (!audits.children.length) el("p", {}, audits, "no operation audit, headroom forecast, shadow or float8 cast in these traces");
    document.getElementById("text-report").textContent = data.text_report;
  }

  summary();
  plots();
  tables();
  document.body.setAttribute("data-rendered", "true");
})();
