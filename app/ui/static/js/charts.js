// Line charts drawn as inline SVG: linear or log y axis, a legend that hides and shows series, a
// hover read-out of every series at the nearest x, horizontal reference lines. No library.

import {clear, h, s, sig} from "./dom.js";

// Okabe–Ito (colour-blind safe) for the named layouts; random layouts in greys.
const NAMED = {
  optimised: "#0072B2",
  contiguous: "#E69F00",
  "anti-optimised": "#D55E00",
  "heads-only": "#009E73",
  "neurons-only": "#CC79A7",
};
const EXTRA = ["#56B4E9", "#F0E442", "#000000", "#882255", "#44AA99", "#999933"];
// random layouts are baselines: greys of alternating lightness, dashed
const GREYS = ["#7d7d7d", "#3f3f3f", "#ababab", "#5e5e5e", "#959595", "#2b2b2b"];
const DASHES = [null, "6 3", "2 3", "8 3 2 3", "1 2"];

export function layoutColor(name, index = 0) {
  if (NAMED[name]) return NAMED[name];
  const random = /^random-(\d+)$/.exec(name);
  if (random) return GREYS[Math.abs(Number(random[1]) - 1000) % GREYS.length];
  return EXTRA[index % EXTRA.length];
}

/** Legend order: optimised, the ablations, contiguous, then the random baselines by seed. */
export function layoutOrder(names) {
  const rank = (n) => (n === "optimised" ? 0 : n === "contiguous" ? 2 : /^random-\d+$/.test(n) ? 3 : 1);
  return [...names].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b, undefined, {numeric: true}));
}

export function layoutDash(name) {
  return /^random-\d+$/.test(name) ? "5 3" : null;
}

export function seedDash(i) {
  return DASHES[i % DASHES.length];
}

// ---- scales and ticks ----------------------------------------------------------------------------

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const power = 10 ** Math.floor(Math.log10(raw));
  const f = raw / power;
  return (f >= 7.07 ? 10 : f >= 3.16 ? 5 : f >= 1.41 ? 2 : 1) * power;  // the nearest of 1, 2, 5, 10
}

function linearTicks(min, max, count, integer) {
  if (!(max > min)) return [min];
  let step = niceStep(max - min, count);
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let v = Math.ceil(min / step - 1e-9) * step; v <= max + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

function logTicks(min, max) {
  const lo = Math.floor(Math.log10(min));
  const hi = Math.ceil(Math.log10(max));
  const decades = hi - lo;
  const mults = decades <= 1 ? [1, 1.5, 2, 3, 5, 7] : decades <= 3 ? [1, 2, 5] : [1];
  const ticks = [];
  for (let e = lo; e <= hi; e += 1) {
    for (const m of mults) {
      const v = Number((m * 10 ** e).toPrecision(12));
      if (v >= min * 0.999 && v <= max * 1.001) ticks.push(v);
    }
  }
  // a narrow range (less than a decade or two): evenly spaced round values read better
  return ticks.length >= 3 ? ticks : linearTicks(min, max, 4, false);
}

function domainOf(values, log) {
  const ok = values.filter((v) => Number.isFinite(v) && (!log || v > 0));
  if (!ok.length) return log ? [0.1, 1] : [0, 1];
  let lo = Math.min(...ok);
  let hi = Math.max(...ok);
  if (log) {
    if (hi / lo < 1.5) { lo /= 1.25; hi *= 1.25; }
    return [lo / 1.08, hi * 1.08];
  }
  if (hi === lo) { const pad = Math.abs(hi) * 0.1 || 1; return [lo - pad, hi + pad]; }
  const pad = (hi - lo) * 0.06;
  return [lo - pad, hi + pad];
}

// ---- the chart -----------------------------------------------------------------------------------

/**
 * lineChart(container, {
 *   id, title, xLabel, yLabel, log, height, integerX, xFormat, yFormat, xDomain, yDomain, markers,
 *   series: [{key, label, color, dash, points: [[x, y], …]}],   // y may be null: the line breaks
 *   hlines: [{y, label, color, dash}],
 * }) → {update(opts), element}
 */
export function lineChart(container, options) {
  let opts = options;
  const hidden = new Set();
  const svgHost = h("div", {class: "plot"});
  const tooltip = h("div", {class: "chart-tooltip", hidden: true});
  const legend = h("div", {class: "legend", role: "group", "aria-label": "series"});
  const caption = h("figcaption", {class: "chart-title"});
  const figure = h("figure", {class: "chart", "data-chart": opts.id || ""}, caption, h("div", {class: "plot-wrap"}, svgHost, tooltip), legend);
  container.append(figure);
  let lastWidth = 0;

  function visible() {
    return opts.series.filter((sr) => !hidden.has(sr.key));
  }

  function drawLegend() {
    clear(legend);
    const lines = (opts.hlines || []).filter((l) => Number.isFinite(l.y));
    if (opts.series.length < 2 && !opts.alwaysLegend && !lines.length) return;
    for (const sr of opts.series) {
      const swatch = s("svg", {width: 22, height: 10, "aria-hidden": "true"},
        s("line", {x1: 1, y1: 5, x2: 21, y2: 5, stroke: sr.color, "stroke-width": 2.5, "stroke-dasharray": sr.dash || null}));
      const button = h("button", {type: "button", class: ["legend-item", hidden.has(sr.key) && "off"],
                                  "aria-pressed": String(!hidden.has(sr.key)), "data-series": sr.key,
                                  title: "show / hide"}, swatch, sr.label);
      button.addEventListener("click", () => {
        if (hidden.has(sr.key)) hidden.delete(sr.key); else hidden.add(sr.key);
        drawLegend();
        draw(true);
      });
      legend.append(button);
    }
    for (const line of lines) {
      legend.append(h("span", {class: "legend-item legend-hline"},
        s("svg", {width: 22, height: 10, "aria-hidden": "true"},
          s("line", {x1: 1, y1: 5, x2: 21, y2: 5, stroke: line.color || "#555", "stroke-width": 1.5,
                     "stroke-dasharray": line.dash || "5 4"})), line.label || ""));
    }
  }

  function draw(force) {
    const width = Math.max(280, Math.round(svgHost.clientWidth || 640));
    if (!force && width === lastWidth) return;
    lastWidth = width;
    const height = opts.height || 260;
    const compact = width < 420;
    const m = {left: compact ? 48 : 60, right: 14, top: 10, bottom: 42};
    const pw = width - m.left - m.right;
    const ph = height - m.top - m.bottom;
    const log = Boolean(opts.log);
    caption.textContent = opts.title || "";

    const series = visible();
    const xs = series.flatMap((sr) => sr.points.map((p) => p[0]));
    const ys = series.flatMap((sr) => sr.points.map((p) => p[1])).concat((opts.hlines || []).map((l) => l.y));
    let [x0, x1] = opts.xDomain || (xs.length ? [Math.min(...xs), Math.max(...xs)] : [0, 1]);
    if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }
    const [y0, y1] = opts.yDomain || domainOf(ys, log);
    const xSpan = x1 - x0 || 1;
    const X = (v) => m.left + ((v - x0) / xSpan) * pw;
    const Y = log
      ? (v) => m.top + ph - ((Math.log10(v) - Math.log10(y0)) / (Math.log10(y1) - Math.log10(y0))) * ph
      : (v) => m.top + ph - ((v - y0) / (y1 - y0 || 1)) * ph;
    const xFormat = opts.xFormat || ((v) => sig(v, 4));
    const yFormat = opts.yFormat || ((v) => sig(v, 3));

    const svg = s("svg", {class: "chart-svg", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
                          "aria-label": `${opts.title || "chart"}: ${opts.yLabel || "y"} against ${opts.xLabel || "x"}`});
    const grid = s("g", {class: "grid"});
    const axes = s("g", {class: "axes"});
    const yTicks = log ? logTicks(y0, y1) : linearTicks(y0, y1, Math.max(3, Math.round(ph / 45)), false);
    for (const t of yTicks) {
      const y = Y(t);
      if (y < m.top - 0.5 || y > m.top + ph + 0.5) continue;
      grid.append(s("line", {x1: m.left, x2: m.left + pw, y1: y, y2: y}));
      axes.append(s("text", {class: "tick y-tick", x: m.left - 6, y: y + 4, "text-anchor": "end"}, yFormat(t)));
    }
    const xTicks = xs.length ? linearTicks(x0, x1, Math.max(2, Math.round(pw / (compact ? 70 : 90))), opts.integerX) : [];
    for (const t of xTicks) {
      const x = X(t);
      if (x < m.left - 0.5 || x > m.left + pw + 0.5) continue;
      grid.append(s("line", {x1: x, x2: x, y1: m.top, y2: m.top + ph}));
      axes.append(s("text", {class: "tick x-tick", x, y: m.top + ph + 16, "text-anchor": "middle"}, xFormat(t)));
    }
    axes.append(s("line", {class: "axis", x1: m.left, x2: m.left + pw, y1: m.top + ph, y2: m.top + ph}));
    axes.append(s("line", {class: "axis", x1: m.left, x2: m.left, y1: m.top, y2: m.top + ph}));
    axes.append(s("text", {class: "axis-label x-label", x: m.left + pw / 2, y: height - 6, "text-anchor": "middle"},
      opts.xLabel || ""));
    axes.append(s("text", {class: "axis-label y-label", x: 0, y: 0, "text-anchor": "middle",
                           transform: `translate(${compact ? 11 : 14} ${m.top + ph / 2}) rotate(-90)`},
      (opts.yLabel || "") + (log ? " (log)" : "")));
    svg.append(grid, axes);

    const clipId = `clip-${Math.random().toString(36).slice(2)}`;
    svg.append(s("defs", {}, s("clipPath", {id: clipId}, s("rect", {x: m.left - 5, y: m.top - 5, width: pw + 10, height: ph + 10}))));
    const plot = s("g", {"clip-path": `url(#${clipId})`});
    for (const line of opts.hlines || []) {
      if (!Number.isFinite(line.y) || (log && line.y <= 0)) continue;
      const y = Y(line.y);
      plot.append(s("line", {class: "hline", x1: m.left, x2: m.left + pw, y1: y, y2: y, stroke: line.color || "#555",
                             "stroke-dasharray": line.dash || "5 4"}));
    }
    const markers = opts.markers !== false;
    for (const sr of series) {
      let d = "";
      let pen = false;
      for (const [x, y] of sr.points) {
        if (y === null || y === undefined || !Number.isFinite(y) || (log && y <= 0)) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`;
        pen = true;
      }
      const g = s("g", {class: "series", "data-series": sr.key});
      g.append(s("path", {class: "series-line", d, stroke: sr.color, "stroke-dasharray": sr.dash || null}));
      if (markers && sr.points.length <= 400) {
        for (const [x, y] of sr.points) {
          if (y === null || !Number.isFinite(y) || (log && y <= 0)) continue;
          g.append(s("circle", {class: "point", cx: X(x).toFixed(1), cy: Y(y).toFixed(1), r: sr.points.length <= 3 ? 4 : 2.6, fill: sr.color},
            s("title", {}, `${sr.label} · ${opts.xLabel || "x"} ${xFormat(x)} · ${yFormat(y)}`)));
        }
      }
      plot.append(g);
    }
    svg.append(plot);

    // hover read-out: every visible series at the x nearest the pointer
    const cursor = s("line", {class: "cursor", x1: 0, x2: 0, y1: m.top, y2: m.top + ph, visibility: "hidden"});
    const overlay = s("rect", {class: "overlay", x: m.left, y: m.top, width: pw, height: ph, fill: "transparent"});
    svg.append(cursor, overlay);
    const allX = [...new Set(xs)].sort((a, b) => a - b);
    overlay.addEventListener("mousemove", (ev) => {
      if (!allX.length) return;
      const box = svg.getBoundingClientRect();
      const px = ((ev.clientX - box.left) / box.width) * width;
      const xv = x0 + ((px - m.left) / pw) * xSpan;
      let best = allX[0];
      for (const v of allX) if (Math.abs(v - xv) < Math.abs(best - xv)) best = v;
      cursor.setAttribute("x1", X(best));
      cursor.setAttribute("x2", X(best));
      cursor.setAttribute("visibility", "visible");
      const rows = [h("div", {class: "tt-head"}, `${opts.xLabel || "x"} ${xFormat(best)}`)];
      for (const sr of series) {
        const p = sr.points.find((q) => q[0] === best);
        if (!p || p[1] === null || !Number.isFinite(p[1])) continue;
        const dot = h("span", {class: "tt-dot"});
        dot.style.background = sr.color;
        rows.push(h("div", {class: "tt-row"}, dot, h("span", {class: "tt-name"}, sr.label), h("span", {class: "tt-val"}, yFormat(p[1]))));
      }
      clear(tooltip).append(...rows);
      tooltip.hidden = false;
      const left = (X(best) / width) * box.width;
      tooltip.style.left = `${Math.min(Math.max(0, left + 12), box.width - tooltip.offsetWidth - 4)}px`;
      tooltip.style.top = `${Math.max(0, ((ev.clientY - box.top) / box.height) * box.height - tooltip.offsetHeight - 8)}px`;
    });
    overlay.addEventListener("mouseleave", () => {
      cursor.setAttribute("visibility", "hidden");
      tooltip.hidden = true;
    });

    if (!series.some((sr) => sr.points.some((p) => Number.isFinite(p[1])))) {
      svg.append(s("text", {class: "empty", x: m.left + pw / 2, y: m.top + ph / 2, "text-anchor": "middle"},
        opts.emptyText || "no data yet"));
    }
    clear(svgHost).append(svg);
  }

  const observer = typeof ResizeObserver === "function" ? new ResizeObserver(() => draw(false)) : null;
  if (observer) observer.observe(svgHost);
  drawLegend();
  draw(true);

  return {
    element: figure,
    update(next) {
      opts = {...opts, ...next};
      const keys = new Set(opts.series.map((sr) => sr.key));
      for (const k of [...hidden]) if (!keys.has(k)) hidden.delete(k);
      drawLegend();
      draw(true);
    },
    destroy() {
      if (observer) observer.disconnect();
      figure.remove();
    },
  };
}
