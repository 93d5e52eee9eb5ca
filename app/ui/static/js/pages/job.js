// Job detail: status and live progress, stage timeline, layouts table, per-layer co-located
// fractions (the paper's Figure 9 view), distillation curves, how to serve the shards with vLLM, artifacts.

import {api, artifactPath, curlFor, downloadWithKey, getKey, apiUrl, specInfo} from "../api.js";
import {layoutColor, layoutDash, layoutOrder, lineChart, seedDash} from "../charts.js";
import {ACTIVE, ago, bytes, copyButton, duration, h, num, poller, progressBar, replace, shortId, sig, stagesSeconds,
  printable, statusBadge, submittedToFinished, when} from "../dom.js";

// A colour per timeline span, in the order a job runs: waiting in the queue, then each stage of the
// server's list (GET /v1/spec `stages`), so that a new stage gets the next colour.
const STAGE_PALETTE = ["#c9ced6", "#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494",
                       "#b3b3b3"];
let spans = ["queued"];
const stageColor = (stage) => STAGE_PALETTE[spans.indexOf(stage)] || "#bbb";

// A layer's fraction is null where the job's schedule has no such edge (spd:B: only its layers' syncs drop).
const present = (xs) => (xs || []).filter((x) => x !== null && x !== undefined);
const mean = (xs) => {
  const kept = present(xs);
  return kept.length ? kept.reduce((a, b) => a + b, 0) / kept.length : null;
};

function card(id, title, ...children) {
  return h("section", {class: "card", id}, h("div", {class: "card-head"}, h("h2", {}, title)), ...children);
}

// ---- header and progress ---------------------------------------------------------------------------

function header(job, {onCancel, onDelete}) {
  const spec = job.spec || {};
  const model = spec.model || {};
  const cal = spec.calibration || {};
  const meta = [
    ["Model", [model.id, model.gguf_file ? ` (${model.gguf_file})` : "", model.revision ? ` @ ${model.revision}` : ""].join("")],
    ["Devices L · schedule", `${spec.devices} · ${job.schedule}`],
    ["Score", spec.score || "fo"],
    ["Distillation ranks W", spec.distill ? String(spec.distill.world_size ?? 1) : "— (no distillation)"],
    ["Calibration", `${cal.source} · ${cal.sequences ?? 64} × ${cal.seq_len ?? 1024} tokens`],
    ["Owner", job.owner || "—"],
    ["Submitted", `${when(job.created_at)} (${ago(job.created_at)})`],
    ["Finished", job.finished_at ? when(job.finished_at) : "—"],
    ["Attempts", String(job.attempts)],
    ["Device", job.device && job.device.device
      ? `${job.device.device}${job.device.name ? ` (${job.device.name})` : ""}` : "—"],
    ["Affinity", job.affinity_cached ? "from the cache (same model and calibration)" : "computed by this job"],
  ];
  if (job.expired_at) {
    meta.push(["Artifacts", `removed ${when(job.expired_at)} (${job.expired_reason === "deleted" ? "deleted"
      : "past the retention period"}); the layouts and scores stay`]);
  }
  const actions = h("div", {class: "actions"},
    ACTIVE.has(job.status) && !job.cancel_requested
      ? h("button", {type: "button", class: "danger", id: "cancel-job", onclick: onCancel}, "Cancel job") : null,
    !ACTIVE.has(job.status) && !job.expired_at
      ? h("button", {type: "button", class: "danger", id: "delete-job", onclick: onDelete}, "Delete artifacts") : null,
    h("a", {class: "button ghost", href: `submit?from=${job.id}`, "data-link": ""}, "Submit again…"));
  const body = [
    h("div", {class: "card-head"}, h("h1", {}, "Job ", h("span", {class: "mono", title: job.id}, shortId(job.id))),
      statusBadge(job.status, job.cancel_requested && ACTIVE.has(job.status) ? "(cancelling)" : null), actions),
    h("dl", {class: "meta"}, meta.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
  ];
  if (job.status === "running") {
    const pct = Math.round((job.progress || 0) * 100);
    body.push(h("div", {class: "live", id: "live-progress"},
      h("div", {class: "stage-line"}, h("strong", {}, job.stage || "starting"),
        h("span", {class: "muted"}, `${pct}%`,
          job.eta_s !== null && job.eta_s !== undefined ? ` · about ${duration(job.eta_s)} left in this stage` : "")),
      progressBar(job.progress, `${job.stage}: ${pct}%`)));
  }
  if (job.status === "queued") body.push(h("p", {class: "muted"}, "Waiting for a worker…"));
  if (job.error) {
    body.push(h("div", {class: job.status === "failed" ? "error-box" : "note-box", id: "job-error"},
      h("strong", {}, job.status === "failed" ? `Failed in ${job.error_stage || job.stage || "?"}: ` : "Note: "),
      h("pre", {class: "error-text"}, printable(job.error))));
  }
  return body;
}

// ---- timeline ------------------------------------------------------------------------------------

function timeline(job) {
  const entries = (job.timeline || []).filter((e) => e.seconds !== null || e.state === "running");
  if (!entries.length) return [h("p", {class: "muted"}, "No stage has started yet.")];
  const total = entries.reduce((a, e) => a + (e.seconds || 0), 0) || 1;
  const bar = h("div", {class: "gantt", role: "img", "aria-label": "stage durations"});
  for (const e of entries) {
    const seg = h("span", {class: ["seg", `state-${e.state}`], "data-stage": e.stage,
                           title: `${e.stage}: ${duration(e.seconds)} (${e.state})`},
      (e.seconds || 0) / total > 0.07 ? e.stage : "");
    seg.style.flexGrow = String(Math.max(e.seconds || 0, total * 0.004));
    seg.style.background = stageColor(e.stage);
    bar.append(seg);
  }
  const rows = entries.map((e) => h("tr", {"data-stage": e.stage, "data-state": e.state},
    h("td", {}, h("span", {class: "swatch-dot", "data-stage": e.stage}), e.stage),
    h("td", {class: "num"}, e.attempt || "—"),
    h("td", {class: "hide-narrow"}, when(e.started_at)),
    h("td", {class: "num"}, duration(e.seconds), e.state === "running" ? " …" : ""),
    h("td", {}, h("span", {class: ["state", `state-${e.state}`]}, e.state))));
  for (const dot of rows.map((r) => r.querySelector(".swatch-dot"))) dot.style.background = stageColor(dot.dataset.stage);
  const wall = submittedToFinished(job);  // what the jobs list shows too
  return [bar, h("div", {class: "table-wrap"}, h("table", {class: "timeline"},
    h("thead", {}, h("tr", {}, h("th", {}, "Stage"), h("th", {class: "num"}, "Attempt"), h("th", {class: "hide-narrow"}, "Started"),
      h("th", {class: "num"}, "Duration"), h("th", {}, "State"))),
    h("tbody", {}, rows))),
    wall !== null ? h("p", {class: "muted", id: "wall-time", "data-wall": duration(wall)},
      `Submitted to finished: ${duration(wall)} (the stages themselves ran ${duration(stagesSeconds(job))}; `
      + "the rest: waiting for a worker, and between stages).") : null];
}

// ---- layouts -------------------------------------------------------------------------------------

function layoutsTable(job, items) {
  const first = items[0];
  const rows = items.map((l) => h("tr", {"data-layout": l.name},
    h("td", {}, h("span", {class: "swatch-dot", "data-color": layoutColor(l.name)}), l.name),
    h("td", {class: "num"}, num(l.J, 3)),
    h("td", {class: "num"}, num(l.J / l.upper_bound, 3)),
    h("td", {class: "num"}, num(mean(l.up_fraction), 3)),
    h("td", {class: "num"}, num(mean(l.down_fraction), 3)),
    h("td", {class: "hide-narrow"}, h("a", {href: apiUrl(`v1/jobs/${job.id}/layouts/${encodeURIComponent(l.name)}`).href,
                                             class: "json-link", "data-layout-json": l.name,
                                             onclick: (ev) => saveJson(ev, job, l.name)}, "dtp-layout/1 JSON"))));
  for (const dot of rows.map((r) => r.querySelector(".swatch-dot"))) dot.style.background = dot.dataset.color;
  return [
    h("div", {class: "table-wrap"}, h("table", {class: "layouts", id: "layouts-table"},
      h("thead", {}, h("tr", {}, h("th", {}, "Layout"), h("th", {class: "num"}, "J"), h("th", {class: "num"}, "J / bound"),
        h("th", {class: "num", title: "mean over layers of the co-located up-edge mass"}, "mean up"),
        h("th", {class: "num", title: "mean over layers of the co-located down-edge mass"}, "mean down"),
        h("th", {class: "hide-narrow"}, ""))),
      h("tbody", {}, rows))),
    h("p", {class: "muted", id: "layouts-footer"},
      `random expectation (2N−1)/L = ${num(first.random_expectation, 3)}; upper bound = ${num(first.upper_bound, 3)}`,
      first.upper_bound_exact ? "" : " (relaxed)",
      job.summary && job.summary.tokens ? `; ${job.summary.tokens} calibration tokens` : ""),
  ];
}

async function saveJson(ev, job, name) {
  if (!getKey()) return; // the plain link works without a key
  ev.preventDefault();
  await downloadWithKey(`v1/jobs/${job.id}/layouts/${encodeURIComponent(name)}`, `${name}.json`, null);
}

function fractionSeries(items, key) {
  const byName = new Map(items.map((l) => [l.name, l]));
  return layoutOrder(byName.keys()).map((name, i) => ({
    key: name, label: name, color: layoutColor(name, i), dash: layoutDash(name),
    points: (byName.get(name)[key] || []).map((v, layer) => [layer, v]).filter(([, v]) => v !== null),
  }));
}

// ---- distillation ----------------------------------------------------------------------------------

function curveSeries(curves, metric) {
  const seeds = [...new Set(curves.map((c) => c.seed))].sort((a, b) => a - b);
  const layouts = [...new Set(curves.map((c) => c.layout))];
  return curves.map((c) => ({
    key: `${c.layout}/${c.seed}`,
    label: seeds.length > 1 ? `${c.layout} · seed ${c.seed}` : c.layout,
    color: layoutColor(c.layout, layouts.indexOf(c.layout)),
    dash: seeds.length > 1 ? seedDash(seeds.indexOf(c.seed)) : layoutDash(c.layout),
    points: c.steps.map((st, i) => [st, c[metric] ? c[metric][i] : null]),
  }));
}

function headline(summary, spec) {
  const head = summary && summary.headline;
  if (!head) {
    return h("p", {class: "muted", id: "distill-headline"}, summary ? "No headline: the job did not distil both the "
      + "reference (contiguous) and the candidate (optimised)." : `Curves update as evaluations come in (every ${
      (spec.distill.recipe && spec.distill.recipe.eval_every) || 100} steps).`);
  }
  // the sentence the summary carries (models/distill/comparison/speedup.py headline_text): the slowest seed's
  // speedup with the seeds' range, or "one seed"; a summary from before it gives its mean curve's step, unrated
  const reach = head.candidate_step_to_reference_final_kl;
  const said = head.said || (reach !== null && reach !== undefined
    ? `${head.candidate}'s mean curve reaches ${head.reference}'s final KL at step ${Math.round(reach)} (mean over seeds, no spread).`
    : `${head.candidate}'s mean curve does not reach ${head.reference}'s final KL.`);
  const lines = [h("p", {class: "headline", id: "distill-headline"}, said,
    ` Final KL: ${head.candidate} ${sig(head.candidate_final_kl, 4)}, ${head.reference} ${sig(head.reference_final_kl, 4)}.`,
    summary.dense_ppl ? ` Dense perplexity ${sig(summary.dense_ppl, 4)}.` : "")];
  if (head.multipliers && head.multipliers.length) {
    lines.push(h("p", {class: "muted"}, "Per evaluation, on the seeds' mean curves (no spread):"));
    lines.push(h("div", {class: "table-wrap"}, h("table", {class: "multipliers"},
      h("thead", {}, h("tr", {}, h("th", {}, `${head.reference} step`), h("th", {class: "num"}, "KL"),
        h("th", {class: "num"}, `${head.candidate} step`), h("th", {class: "num"}, "multiplier"))),
      h("tbody", {}, head.multipliers.map((r) => h("tr", {},
        h("td", {class: "num"}, r.step), h("td", {class: "num"}, sig(r.reference_kl, 4)),
        h("td", {class: "num"}, r.candidate_step === null ? "—" : num(r.candidate_step, 1)),
        h("td", {class: "num"}, r.multiplier === null ? "—" : `${r.multiplier.toFixed(2)}×`)))))));
  }
  return lines;
}

// ---- artifacts -----------------------------------------------------------------------------------

/** kind → what its files are, from the declared artifacts (GET /v1/spec `artifacts`: a kind may have several). */
function artifactKinds(declared) {
  const out = {};
  for (const a of declared || []) out[a.kind] = out[a.kind] ? `${out[a.kind]}; ${a.doc}` : a.doc;
  return out;
}

function artifactsTable(job, items, kinds = {}) {
  if (!items.length) return [h("p", {class: "muted"}, ACTIVE.has(job.status) ? "Artifacts appear as stages finish." : "No artifacts.")];
  const total = items.reduce((a, x) => a + x.size, 0);
  const status = h("p", {class: "muted", id: "download-status", role: "status"});
  const rows = items.map((a) => {
    const path = artifactPath(job.id, a.name);
    const filename = a.name.split("/").pop();
    const link = h("a", {href: apiUrl(path).href, download: filename, class: "download", "data-artifact": a.name}, "download");
    link.addEventListener("click", async (ev) => {
      if (!getKey()) return; // no key: the browser streams the file itself
      ev.preventDefault();
      status.textContent = `downloading ${a.name} (${bytes(a.size)})…`;
      try {
        const {verified, redirected} = await downloadWithKey(path, filename, a.sha256);
        status.textContent = `${a.name}: ${redirected ? "downloading from the store (sha256 verified by the service)"
          : verified ? "sha256 verified" : "downloaded"}`;
      } catch (err) {
        status.textContent = `${a.name}: ${err.message}`;
      }
    });
    return h("tr", {"data-artifact": a.name},
      h("td", {class: "mono name-cell", title: a.name}, a.name),
      h("td", {class: "hide-narrow", title: kinds[a.kind]}, a.kind),
      h("td", {class: "num"}, bytes(a.size)),
      h("td", {class: "mono hide-narrow", title: a.sha256}, a.sha256.slice(0, 12), "…", copyButton(a.sha256, "sha256")),
      h("td", {class: "nowrap"}, link, " ", copyButton(curlFor(path, {output: filename}), "curl")));
  });
  return [
    h("div", {class: "table-wrap"}, h("table", {class: "artifacts", id: "artifacts-table"},
      h("thead", {}, h("tr", {}, h("th", {}, "Name"), h("th", {class: "hide-narrow"}, "Kind"), h("th", {class: "num"}, "Size"),
        h("th", {class: "hide-narrow"}, "sha256"), h("th", {}, ""))),
      h("tbody", {}, rows))),
    h("p", {class: "muted"}, `${items.length} files, ${bytes(total)}. Everything at once, resumable and checked: `,
      h("code", {}, `dtp-layout client download ${job.id} --out ./${shortId(job.id)}`), " ",
      copyButton(`dtp-layout client download ${job.id} --out ./${shortId(job.id)}`)),
    status,
  ];
}

// ---- serving ------------------------------------------------------------------------------------

/** The summary's `serve` (the worker writes it when the job succeeds: models/serving/commands.py): the
 *  client's download of the shards and `dtp-layout vllm-serve` on them, shown as written (text only, through
 *  h()). null for a job without shards to serve: not succeeded, no shards exported, or artifacts removed. */
function serveBlock(job) {
  const serve = job.summary && job.summary.serve;
  if (job.status !== "succeeded" || job.expired_at || !serve || !serve.available) return null;
  const commands = serve.commands || [];
  return [
    h("p", {class: "muted"}, "vLLM's OpenAI-compatible server on this job's rank shards, at ",
      h("strong", {id: "serve-tp"}, `tensor-parallel size ${serve.devices}`), ` (the shards' L), schedule ${serve.schedule}`,
      serve.architecture ? ` (${serve.architecture})` : "", ":"),
    h("div", {class: "serve-steps"}, commands.map((c) => h("div", {class: "serve-step"},
      h("pre", {class: "code serve-command"}, c), copyButton(c)))),
    h("p", {class: "muted"}, "The download reads the service's address and key from DTP_LAYOUT_URL and "
      + "DTP_LAYOUT_API_KEY (or --url, --api-key); vllm-serve runs vLLM from .venv-vllm (make vllm-env) or --python. "
      + "More: ", h("code", {id: "serve-docs"}, serve.docs || "docs/serving.md"), " in the repository."),
  ];
}

// ---- the page ------------------------------------------------------------------------------------

export function renderJob(container, {id}) {
  document.title = `Job ${shortId(id)} · dtp-layout`;
  const head = h("section", {class: "card", id: "job-header"}, h("p", {class: "muted"}, "Loading…"));
  const timelineCard = card("timeline", "Stage timeline");
  const layoutsCard = card("layouts", "Layouts");
  const fractionsCard = card("fractions", "Co-located fraction per layer");
  const distillCard = card("distill", "Distillation");
  const serveCard = card("serve", "Serve with vLLM");
  const artifactsCard = card("artifacts", "Artifacts");
  for (const c of [layoutsCard, fractionsCard, distillCard, serveCard]) c.hidden = true;
  const layoutsBody = h("div", {});
  const fractionsBody = h("div", {class: "chart-grid"});
  const distillHead = h("div", {});
  const distillCharts = h("div", {class: "chart-grid"});
  const timelineBody = h("div", {});
  const artifactsBody = h("div", {});
  const serveBody = h("div", {});
  serveCard.append(serveBody);
  layoutsCard.append(layoutsBody);
  fractionsCard.append(h("p", {class: "muted"}, "Share of each layer's affinity mass that a layout keeps on one device: up edges "
    + "(attention heads → FFN neurons of the same layer) and down edges (neurons → next layer's KV groups). "
    + "A random layout keeps 1/L."), fractionsBody);
  distillCard.append(distillHead, distillCharts);
  timelineCard.append(timelineBody);
  artifactsCard.append(artifactsBody);
  container.append(head, timelineCard, layoutsCard, fractionsCard, distillCard, serveCard, artifactsCard);

  let job = null;
  let seen = "";
  let finishedAndLoaded = false;
  const charts = {};

  async function cancel() {
    try {
      job = await api(`v1/jobs/${id}/cancel`, {method: "POST"});
      renderHead();
    } catch (err) {
      window.alert(err.message);
    }
  }

  async function removeArtifacts() {
    if (!window.confirm("Delete this job's artifacts from the store? The job, its layouts and scores stay.")) return;
    try {
      job = await api(`v1/jobs/${id}`, {method: "DELETE"});
      renderHead();
      await loadArtifacts();
    } catch (err) {
      window.alert(err.message);
    }
  }

  function renderHead() {
    replace(head, header(job, {onCancel: cancel, onDelete: removeArtifacts}));
    replace(timelineBody, timeline(job));
    const serve = serveBlock(job);
    serveCard.hidden = serve === null;
    replace(serveBody, serve);
  }

  async function loadLayouts() {
    const {items} = await api(`v1/jobs/${id}/layouts`);
    if (!items.length) return;
    layoutsCard.hidden = false;
    fractionsCard.hidden = false;
    replace(layoutsBody, layoutsTable(job, items));
    const L = job.spec.devices;
    const hline = [{y: 1 / L, label: `random 1/L = ${sig(1 / L, 3)}`, color: "#333"}];
    const common = {xLabel: "layer", yLabel: "co-located fraction", integerX: true, yDomain: [0, 1], hlines: hline,
                    xFormat: (v) => String(Math.round(v)), height: 280};
    const up = {...common, id: "fractions-up", title: "Up edges: attention → FFN (same layer)", series: fractionSeries(items, "up_fraction")};
    const down = {...common, id: "fractions-down", title: "Down edges: FFN → next layer's attention", series: fractionSeries(items, "down_fraction")};
    if (charts.up) { charts.up.update(up); charts.down.update(down); } else {
      charts.up = lineChart(fractionsBody, up);
      charts.down = lineChart(fractionsBody, down);
    }
  }

  async function loadMetrics() {
    const metrics = await api(`v1/jobs/${id}/metrics`);
    distillCard.hidden = false;
    replace(distillHead, headline(metrics.summary, job.spec));
    const kl = {id: "distill-kl", title: "KL(dense ‖ DTP) on the evaluation blocks", xLabel: "step", yLabel: "KL (nats/token)",
                log: true, integerX: true, xFormat: (v) => String(Math.round(v)), series: curveSeries(metrics.curves, "kl"),
                emptyText: "waiting for the first evaluation", alwaysLegend: true};
    const dense = metrics.summary && metrics.summary.dense_ppl;
    const ppl = {id: "distill-ppl", title: "DTP perplexity", xLabel: "step", yLabel: "perplexity", log: true, integerX: true,
                 xFormat: (v) => String(Math.round(v)), series: curveSeries(metrics.curves, "ppl"),
                 hlines: dense ? [{y: dense, label: `dense ${sig(dense, 4)}`, color: "#333"}] : [],
                 emptyText: "waiting for the first evaluation", alwaysLegend: true};
    if (charts.kl) { charts.kl.update(kl); charts.ppl.update(ppl); } else {
      charts.kl = lineChart(distillCharts, kl);
      charts.ppl = lineChart(distillCharts, ppl);
    }
  }

  async function loadArtifacts() {
    if (job.expired_at) {
      replace(artifactsBody, h("p", {class: "muted", id: "artifacts-expired"}, `The artifacts were removed ${when(job.expired_at)} `
        + `(${job.expired_reason === "deleted" ? "deleted" : "past the retention period"}).`));
      return;
    }
    const {items} = await api(`v1/jobs/${id}/artifacts`);
    // what each kind is: the server's declaration (GET /v1/spec `artifacts`); without it, the bare kinds
    let kinds = {};
    try { kinds = artifactKinds((await specInfo()).artifacts); } catch { /* the table still shows */ }
    replace(artifactsBody, artifactsTable(job, items, kinds));
  }

  async function tick() {
    if (finishedAndLoaded) return;
    try {
      job = await api(`v1/jobs/${id}`);
    } catch (err) {
      replace(head, h("h1", {}, `Job ${shortId(id)}`), h("p", {class: "error-box", role: "alert"}, err.message));
      if (err.status === 404) finishedAndLoaded = true;
      return;
    }
    if (spans.length === 1) {  // the stage order, once the job has answered (with the key)
      try { spans = ["queued", ...(await specInfo()).stages]; } catch { /* grey spans; the job still shows */ }
    }
    renderHead();
    const key = `${job.status}|${(job.stages_done || []).join(",")}`;
    const changed = key !== seen;
    seen = key;
    const tasks = [];
    if (changed && (job.stages_done || []).includes("optimising")) tasks.push(loadLayouts());
    if (changed) tasks.push(loadArtifacts());
    if (job.spec.distill && (changed || job.stage === "distilling")) tasks.push(loadMetrics());
    await Promise.all(tasks);
    if (!ACTIVE.has(job.status)) finishedAndLoaded = true;
  }

  tick();
  return poller(tick, () => (job && job.stage === "distilling" ? 3000 : 2000));
}
