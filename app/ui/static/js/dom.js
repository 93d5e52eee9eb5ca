// DOM building and formatting helpers. Text always goes in through textContent (never innerHTML),
// so nothing the API returns is ever parsed as markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function setAttrs(el, attrs) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") el.textContent = String(value);
    else if (name === "class") el.setAttribute("class", Array.isArray(value) ? value.filter(Boolean).join(" ") : value);
    else if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name === "value" && "value" in el) el.value = value;
    else if (name === "checked" || name === "disabled" || name === "selected") el[name] = Boolean(value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
}

/** h("a", {href: "…", class: "x", onclick: fn}, "text", child, [more]) */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

/** The same for SVG elements. */
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  clear(el);
  append(el, children);
  return el;
}

// ---- formatting ----------------------------------------------------------------------------------

export function num(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  return Number(x).toFixed(digits);
}

/** 3 significant digits, switching to exponent notation for very small or large values. */
export function sig(x, digits = 3) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "—";
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(digits - 1);
  return Number(x.toPrecision(digits)).toString();
}

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${n} B` : `${v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

/** 75 → "1m 15s"; 3725 → "1h 2m"; 4.2 → "4.2s". */
export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
  if (seconds < 10) return `${seconds.toFixed(1)}s`;
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const hr = Math.floor(m / 60);
  if (hr < 48) return `${hr}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(hr / 24)}d ${hr % 24}h`;
}

/** A finished job's time, as the jobs list and the job page both show it: from its submission to its end
 * (queued and between-stage time included: what its submitter waited), in seconds; null until it ends. */
export function submittedToFinished(job) {
  const start = parseDate(job.created_at);
  const end = parseDate(job.finished_at);
  return start && end ? Math.max(0, (end - start) / 1000) : null;
}

/** The seconds its stages themselves ran (the sum of `timings`). */
export function stagesSeconds(job) {
  return Object.values(job.timings || {}).reduce((a, b) => a + b, 0);
}

export function parseDate(text) {
  if (!text) return null;
  const d = new Date(text);
  return Number.isNaN(d.getTime()) ? null : d;
}

export function ago(text, now = Date.now()) {
  const d = parseDate(text);
  if (!d) return "—";
  const s = Math.max(0, (now - d.getTime()) / 1000);
  if (s < 45) return "just now";
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function when(text) {
  const d = parseDate(text);
  if (!d) return "—";
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

// Every character Python's str.isprintable refuses (controls, format, separators but the space,
// unassigned): text from a tenant's file (a job's error, issue 41) is shown as data, never as layout.
const NOT_PRINTABLE = /[\p{C}\p{Z}]/gu;
const SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"};

/** `text` with each non-printable character written as an escape (`\x1b`, `\n`, `\u2028`), as the
 *  service's logs write it (app/core/safe_text.py for_log). */
export function printable(text) {
  return String(text).replace(NOT_PRINTABLE, (c) => {
    if (c === " ") return c;
    if (SHORT_ESCAPES[c]) return SHORT_ESCAPES[c];
    const code = c.codePointAt(0);
    const hex = code.toString(16);
    return code < 0x100 ? `\\x${hex.padStart(2, "0")}` : code < 0x10000 ? `\\u${hex.padStart(4, "0")}`
      : `\\U${hex.padStart(8, "0")}`;
  });
}

export function shortId(id) {
  return id ? id.slice(0, 8) : "—";
}

export const ACTIVE = new Set(["queued", "running"]);

export function statusBadge(status, extra) {
  return h("span", {class: ["badge", `status-${status}`], "data-status": status}, status, extra ? ` ${extra}` : null);
}

/** A progress bar: fraction in [0, 1]. */
export function progressBar(fraction, label) {
  const pct = Math.max(0, Math.min(1, fraction || 0)) * 100;
  const fill = h("span", {class: "fill"});
  fill.style.width = `${pct.toFixed(1)}%`;
  return h("span", {class: "progress", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100",
                    "aria-valuenow": pct.toFixed(0), title: label || `${pct.toFixed(0)}%`}, fill);
}

/** A button that copies `text` to the clipboard and says so. */
export function copyButton(text, label = "copy") {
  const button = h("button", {type: "button", class: "small ghost", title: text}, label);
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "copied";
    } catch {
      window.prompt("Copy:", text);
    }
    setTimeout(() => { button.textContent = label; }, 1500);
  });
  return button;
}

/** Repeats `fn` every `interval()` ms (a function, so the pace can follow the data) until stopped;
 *  pauses while the tab is hidden. */
export function poller(fn, interval) {
  let timer = null;
  let stopped = false;
  const tick = async () => {
    timer = null;
    if (stopped) return;
    if (!document.hidden) {
      try { await fn(); } catch (err) { console.error(err); }
    }
    if (!stopped) timer = setTimeout(tick, interval());
  };
  const onVisible = () => { if (!document.hidden && timer !== null) { clearTimeout(timer); tick(); } };
  document.addEventListener("visibilitychange", onVisible);
  timer = setTimeout(tick, interval());
  return () => {
    stopped = true;
    if (timer !== null) clearTimeout(timer);
    document.removeEventListener("visibilitychange", onVisible);
  };
}
