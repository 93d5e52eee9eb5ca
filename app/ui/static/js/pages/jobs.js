// Jobs list: newest first, filters in the URL, refreshes itself while jobs run.

import {api, specInfo} from "../api.js";
import {ACTIVE, ago, duration, h, num, poller, progressBar, replace, shortId, stagesSeconds, statusBadge,
  printable, submittedToFinished} from "../dom.js";

const PAGE = 25;

function stageCell(job) {
  if (job.status === "running") {
    const eta = job.eta_s !== null && job.eta_s !== undefined ? ` · ETA ${duration(job.eta_s)}` : "";
    return h("div", {class: "stage-cell"},
      h("div", {class: "stage-line"}, h("span", {class: "stage-name"}, job.stage || "starting"),
        h("span", {class: "muted"}, `${Math.round((job.progress || 0) * 100)}%${eta}`)),
      progressBar(job.progress, `${job.stage}: ${Math.round((job.progress || 0) * 100)}%`));
  }
  if (job.status === "queued") return h("span", {class: "muted"}, "waiting for a worker");
  if (job.status === "failed") {
    const error = printable(job.error || "");  // one line: a line break in it shown as \n
    return h("span", {class: "error-text", title: error}, `${job.error_stage || job.stage || "?"}: `,
      error.slice(0, 80));
  }
  if (job.status === "cancelled") return h("span", {class: "muted"}, job.stage ? `in ${job.stage}` : "before it started");
  // the job page's "submitted to finished" (dom.js submittedToFinished), not the stages' sum
  const wall = submittedToFinished(job);
  return h("span", {class: "muted", "data-wall": wall === null ? "" : duration(wall),
                    title: `submitted to finished; the stages themselves ran ${duration(stagesSeconds(job))}`},
    `${(job.stages_done || []).length} stages · ${duration(wall)}`);
}

function scoreCells(job) {
  const layouts = (job.summary && job.summary.layouts) || {};
  const opt = layouts.optimised;
  const ref = layouts.contiguous;
  const gain = opt !== undefined && ref ? opt / ref : null;
  return [
    h("td", {class: "num", "data-col": "j-opt"}, num(opt, 2)),
    h("td", {class: "num hide-narrow", "data-col": "j-ref"}, num(ref, 2)),
    h("td", {class: "num hide-narrow", "data-col": "gain"}, gain === null ? "—" : `×${gain.toFixed(2)}`),
  ];
}

function row(job) {
  const spec = job.spec || {};
  const model = (spec.model && spec.model.id) || "?";
  return h("tr", {"data-job": job.id, "data-status": job.status},
    h("td", {"data-col": "job"},
      h("a", {href: `jobs/${job.id}`, "data-link": "", class: "mono", title: job.id}, shortId(job.id)),
      h("span", {class: "show-narrow"}, " ", statusBadge(job.status))),
    h("td", {class: "hide-narrow"},
      statusBadge(job.status, job.cancel_requested && ACTIVE.has(job.status) ? "(cancelling)" : null)),
    h("td", {class: "model-cell", "data-col": "model", title: model}, model,
      h("div", {class: "sub show-narrow"}, `L=${spec.devices ?? "?"} · ${job.schedule}`
        + `${job.owner ? ` · ${job.owner}` : ""} · ${ago(job.created_at)}`)),
    h("td", {class: "num hide-narrow"}, spec.devices ?? "—"),
    h("td", {class: "mono hide-narrow schedule-cell", "data-col": "schedule", title: job.schedule}, job.schedule),
    h("td", {class: "stage-col", "data-col": "stage"}, stageCell(job)),
    ...scoreCells(job),
    h("td", {class: "hide-narrow"}, job.owner || h("span", {class: "muted"}, "—")),
    h("td", {class: "age hide-narrow", title: job.created_at}, ago(job.created_at)),
  );
}

function statusOptions(params, names) {
  return ["", ...names].map((st) => h("option", {value: st, selected: params.get("status") === st}, st || "any status"));
}

function filterForm(params, apply) {
  // the status names are the server's (GET /v1/spec, asked once the list has loaded: with the key);
  // until they come, the one the URL asks for
  const status = h("select", {name: "status", id: "filter-status"},
    statusOptions(params, params.get("status") ? [params.get("status")] : []));
  const model = h("input", {name: "model", id: "filter-model", placeholder: "model id", value: params.get("model") || ""});
  const devices = h("input", {name: "devices", type: "number", min: 1, placeholder: "L", class: "narrow",
                              value: params.get("devices") || ""});
  // any form of the schedule grammar (the server compares it canonical; a bad one: its 422 names the forms)
  const schedule = h("input", {name: "schedule", id: "filter-schedule", placeholder: "schedule, e.g. pt:2",
                               class: "mono", value: params.get("schedule") || ""});
  const owner = h("input", {name: "owner", id: "filter-owner", placeholder: "owner", value: params.get("owner") || ""});
  const form = h("form", {class: "filters", role: "search"}, status, model, devices, schedule, owner,
    h("button", {type: "submit", class: "small"}, "Filter"),
    h("button", {type: "button", class: "small ghost", onclick: () => apply(new URLSearchParams())}, "Clear"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const next = new URLSearchParams();
    for (const el of [status, model, devices, schedule, owner]) if (el.value.trim()) next.set(el.name, el.value.trim());
    apply(next);
  });
  status.addEventListener("change", () => form.requestSubmit());
  return form;
}

export function renderJobs(container, {params, navigate}) {
  document.title = "Jobs · dtp-layout";
  const body = h("tbody", {});
  const info = h("span", {class: "muted", id: "jobs-total"});
  const pager = h("div", {class: "pager"});
  const error = h("p", {class: "error-box", hidden: true, role: "alert"});
  const offset = Math.max(0, Number(params.get("offset") || 0));
  let anyActive = false;

  const apply = (next) => navigate(`./?${next.toString()}`, {replace: true});
  const filters = filterForm(params, apply);
  let statusesShown = false;
  container.append(
    h("section", {class: "card"},
      h("div", {class: "card-head"}, h("h1", {}, "Jobs"), info,
        h("a", {href: "submit", "data-link": "", class: "button"}, "New job")),
      filters, error,
      h("div", {class: "table-wrap"},
        h("table", {class: "jobs", id: "jobs-table"},
          h("thead", {}, h("tr", {},
            h("th", {}, "Job"), h("th", {class: "hide-narrow"}, "Status"), h("th", {}, "Model"),
            h("th", {class: "num hide-narrow", title: "devices"}, "L"),
            h("th", {class: "hide-narrow", title: "the communication schedule the job runs"}, "Schedule"),
            h("th", {}, "Stage"),
            h("th", {class: "num", title: "J of the optimised layout"}, "J opt"),
            h("th", {class: "num hide-narrow", title: "J of the contiguous layout"}, "J contig"),
            h("th", {class: "num hide-narrow", title: "optimised / contiguous"}, "gain"),
            h("th", {class: "hide-narrow"}, "Owner"), h("th", {class: "hide-narrow"}, "Age"))),
          body)),
      pager));

  async function load() {
    const query = Object.fromEntries(params.entries());
    delete query.offset;
    let page;
    try {
      page = await api("v1/jobs", {params: {...query, limit: PAGE, offset}});
    } catch (err) {
      error.hidden = false;
      error.textContent = err.message;
      return;
    }
    error.hidden = true;
    if (!statusesShown) {
      statusesShown = true;
      specInfo().then((spec) => replace(filters.elements.status, statusOptions(params, spec.statuses)),
        () => { statusesShown = false; });
    }
    anyActive = page.items.some((j) => ACTIVE.has(j.status));
    replace(body, page.items.length ? page.items.map(row)
      : h("tr", {}, h("td", {colspan: 11, class: "empty-row"}, params.toString() ? "No job matches these filters."
        : ["No jobs yet. ", h("a", {href: "submit", "data-link": ""}, "Submit one"), "."])));
    info.textContent = page.total ? `${offset + 1}–${offset + page.items.length} of ${page.total}` : "";
    const link = (off, label) => {
      const next = new URLSearchParams(params);
      next.set("offset", String(off));
      return h("a", {href: `./?${next}`, "data-link": "", class: "button small ghost"}, label);
    };
    replace(pager, offset > 0 ? link(Math.max(0, offset - PAGE), "← newer") : null,
      offset + page.items.length < page.total ? link(offset + PAGE, "older →") : null);
  }

  load();
  return poller(load, () => (anyActive ? 2000 : 10000));
}
