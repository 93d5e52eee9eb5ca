// Scores per model: J of every layout across the model's succeeded jobs, one chart per (L, schedule, score),
// and the CI gate command that reads the latest of them (of that schedule: a pt:2 job is no dtp:1 job).

import {api} from "../api.js";
import {layoutColor, layoutDash, layoutOrder, lineChart} from "../charts.js";
import {copyButton, h, num, replace, shortId, when} from "../dom.js";

const LIMIT = 200;

function groupCard(model, key, jobs) {
  const [devices, schedule, score] = key.split("|");
  const chronological = [...jobs].sort((a, b) => new Date(a.finished_at) - new Date(b.finished_at));
  const names = layoutOrder(new Set(chronological.flatMap((j) => Object.keys(j.summary.layouts || {}))));
  const latest = chronological[chronological.length - 1];
  const expectation = latest.summary.random_expectation;
  const bound = latest.summary.upper_bound;
  const series = names.map((name, i) => ({key: name, label: name, color: layoutColor(name, i), dash: layoutDash(name),
    points: chronological.map((j, x) => [x + 1, j.summary.layouts[name] ?? null])}));
  const hlines = [];
  if (expectation) hlines.push({y: expectation, label: `random expectation ${num(expectation, 2)}`, color: "#333"});
  if (bound) hlines.push({y: bound, label: `upper bound ${num(bound, 2)}`, color: "#999", dash: "2 3"});
  const chartHost = h("div", {});
  const gate = `dtp-layout client scores --model ${model} --devices ${devices} --schedule ${schedule} --min-ratio 1.2`;
  const section = h("section", {class: "card", "data-group": key},
    h("div", {class: "card-head"}, h("h2", {}, `L = ${devices}, schedule ${schedule}, score ${score}`),
      h("span", {class: "muted"}, `${jobs.length} job${jobs.length === 1 ? "" : "s"}`)),
    chartHost,
    h("div", {class: "table-wrap"}, h("table", {class: "scores"},
      h("thead", {}, h("tr", {}, h("th", {}, "#"), h("th", {}, "Job"), h("th", {class: "hide-narrow"}, "Finished"),
        h("th", {class: "hide-narrow"}, "Calibration"),
        names.map((n) => h("th", {class: "num"}, n)))),
      h("tbody", {}, [...chronological].reverse().map((j) => {
        const cal = j.spec.calibration || {};
        return h("tr", {class: j === latest ? "latest" : null, title: j === latest ? "the latest: what /v1/scores and the CI gate read" : null},
          h("td", {class: "num"}, chronological.indexOf(j) + 1),
          h("td", {}, h("a", {href: `jobs/${j.id}`, "data-link": "", class: "mono"}, shortId(j.id))),
          h("td", {class: "hide-narrow nowrap"}, when(j.finished_at)),
          h("td", {class: "hide-narrow"}, `${cal.source} · ${cal.sequences ?? 64}×${cal.seq_len ?? 1024}`),
          names.map((n) => h("td", {class: "num"}, num(j.summary.layouts[n], 3))));
      })))),
    h("p", {class: "muted"}, "CI gate on the latest: ", h("code", {}, gate), " ", copyButton(gate)));
  // draw once the section is in the document (the chart sizes itself to its container)
  return {section, draw: () => lineChart(chartHost, {id: `scores-${key}`, title: `J per layout, ${model}`, xLabel: "job (oldest → newest)",
    yLabel: "J (co-located mass)", integerX: true, xDomain: [0.6, chronological.length + 0.4], xFormat: (v) => `#${Math.round(v)}`, series, hlines, height: 280})};
}

export function renderScores(container, {params, navigate}) {
  document.title = "Scores · dtp-layout";
  const modelSelect = h("select", {id: "scores-model", name: "model"});
  const devices = h("input", {name: "devices", type: "number", min: 1, placeholder: "L", class: "narrow", value: params.get("devices") || ""});
  const schedule = h("input", {name: "schedule", placeholder: "schedule, e.g. pt:2", class: "mono", value: params.get("schedule") || ""});
  const form = h("form", {class: "filters"}, h("label", {for: "scores-model"}, "Model"), modelSelect, devices, schedule,
    h("button", {type: "submit", class: "small"}, "Show"));
  const body = h("div", {id: "scores-body"});
  container.append(h("section", {class: "card"}, h("div", {class: "card-head"}, h("h1", {}, "Scores")),
    h("p", {class: "muted"}, "J (the co-located affinity mass, eq. 6 of the paper) of each layout across the model's succeeded "
      + "jobs. Higher is better; a random layout scores the random expectation (2N−1)/L on average."), form), body);

  const go = () => {
    const next = new URLSearchParams();
    if (modelSelect.value) next.set("model", modelSelect.value);
    if (devices.value) next.set("devices", devices.value);
    if (schedule.value.trim()) next.set("schedule", schedule.value.trim());
    navigate(`scores?${next}`, {replace: true});
  };
  form.addEventListener("submit", (ev) => { ev.preventDefault(); go(); });
  modelSelect.addEventListener("change", go);

  (async () => {
    let recent;
    try {
      recent = await api("v1/jobs", {params: {status: "succeeded", limit: LIMIT}});
    } catch (err) {
      replace(body, h("p", {class: "error-box", role: "alert"}, err.message));
      return;
    }
    const models = [...new Set(recent.items.map((j) => j.spec.model.id))].sort();
    const model = params.get("model") || models[0] || "";
    if (model && !models.includes(model)) models.unshift(model);
    replace(modelSelect, models.map((m) => h("option", {value: m, selected: m === model}, m)));
    if (!model) {
      replace(body, h("section", {class: "card"}, h("p", {class: "muted"}, "No succeeded job yet.")));
      return;
    }
    let jobs;
    try {
      jobs = await api("v1/jobs", {params: {status: "succeeded", model, devices: params.get("devices"), schedule: params.get("schedule"), limit: LIMIT}});
    } catch (err) {
      replace(body, h("p", {class: "error-box", role: "alert"}, err.message));
      return;
    }
    const groups = new Map();
    for (const j of jobs.items) {
      if (!j.summary || !j.summary.layouts) continue;
      const key = `${j.spec.devices}|${j.schedule}|${j.spec.score || "fo"}`;
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(j);
    }
    if (!groups.size) {
      replace(body, h("section", {class: "card"}, h("p", {class: "muted"}, `No succeeded job of ${model} matches.`)));
      return;
    }
    const cards = [...groups.entries()].sort(([a], [b]) => a.localeCompare(b, undefined, {numeric: true}))
      .map(([key, list]) => groupCard(model, key, list));
    replace(body, cards.map((c) => c.section));
    for (const c of cards) c.draw();
  })();
  return null;
}
