// Submit form: every field of the job spec; the API's 422 messages are shown next to their fields.

import {api, ApiError, apiUrl, getKey} from "../api.js";
import {copyButton, h, replace} from "../dom.js";

// As models.layout_set: the paper's seven spread layouts; the fourth is named after the other score.
const ABLATIONS = ["anti-optimised", "heads-only", "neurons-only", "add-score", "4-layers", "8-layers", "12-layers"];
const RESTARTS_DEFAULT = 4;
const RANDOM_SEED_BASE = 1000;
const DEFAULTS = {
  "model.id": "", "model.gguf_file": "", "model.revision": "", "model.dtype": "float32",
  devices: "3", delta: "1", score: "fo", random_layouts: "2", ablations: false,
  "calibration.source": "corpus:kjv", "calibration.sequences": "8", "calibration.seq_len": "256", "calibration.seed": "",
  "export.checkpoint": true, "export.shards": true, restarts: "", batch_size: "",
  distill: false, "distill.seeds": "0", "distill.steps": "200", "distill.train.source": "", "distill.train.seq_len": "64",
  "distill.eval.source": "corpus:shakespeare", "distill.eval.sequences": "16", "distill.recipe.lr": "1e-4",
  "distill.recipe.min_lr": "1e-5", "distill.recipe.warmup_steps": "20", "distill.recipe.batch_size": "4",
  "distill.recipe.micro_batch_size": "4", "distill.recipe.eval_every": "25",
};

const idOf = (path) => `f-${path.replace(/\./g, "-")}`;

/** A number field's value: a number, undefined when blank, or the raw text (the API names the problem). */
function numeric(text) {
  const t = text.trim();
  if (t === "") return undefined;
  const n = Number(t);
  return Number.isFinite(n) ? n : t;
}

export function renderSubmit(container, {params, navigate}) {
  document.title = "Submit · dtp-layout";
  const inputs = {};
  const errors = {};
  const groups = {};

  function field(path, label, input, hint) {
    input.id = input.id || idOf(path);
    input.name = path;
    inputs[path] = input;
    errors[path] = h("p", {class: "field-error", "data-error-for": path, role: "alert"});
    groups[path] = h("div", {class: ["field", input.type === "checkbox" && "check"], "data-field": path},
      input.type === "checkbox" ? h("label", {for: input.id, class: "inline"}, input, " ", label)
        : [h("label", {for: input.id}, label), input],
      hint ? h("small", {class: "hint"}, hint) : null, errors[path]);
    return groups[path];
  }
  const text = (attrs = {}) => h("input", {type: "text", autocomplete: "off", spellcheck: "false", ...attrs});
  const number = (attrs = {}) => text({inputmode: "decimal", class: "num-input", ...attrs});
  const check = () => h("input", {type: "checkbox"});
  const select = (options) => h("select", {}, options.map(([v, l]) => h("option", {value: v}, l)));

  const modelList = h("datalist", {id: "model-list"});
  const ggufList = h("datalist", {id: "gguf-list"});
  const sourceList = h("datalist", {id: "source-list"},
    ["corpus:kjv", "corpus:shakespeare", "hf:Salesforce/wikitext:wikitext-2-raw-v1:test"].map((v) => h("option", {value: v})));
  const layoutBox = h("div", {class: "checks", id: "distill-layouts"});
  const layoutError = h("p", {class: "field-error", "data-error-for": "distill.layouts", role: "alert"});
  errors["distill.layouts"] = layoutError;
  groups["distill.layouts"] = h("div", {class: "field wide", "data-field": "distill.layouts"},
    h("span", {class: "label"}, "Layouts to distil"), layoutBox, layoutError);
  const general = h("div", {class: "error-box", id: "submit-errors", hidden: true, role: "alert"});
  const preview = h("pre", {class: "code", id: "spec-json"});
  const curl = h("pre", {class: "code", id: "spec-curl"});
  const copyHost = h("span", {});
  const submitButton = h("button", {type: "submit", id: "submit-job"}, "Submit job");

  const distillToggle = check();
  const distillSection = h("div", {class: "grid", id: "distill-fields"},
    groups["distill.layouts"],
    field("distill.seeds", "Training seeds", text({placeholder: "0"}), "comma-separated; each (layout, seed) is one run"),
    field("distill.steps", "Steps", number({placeholder: "1000"}), "optimiser steps per run"),
    field("distill.train.source", "Training data", text({list: "source-list", placeholder: "the calibration source"})),
    field("distill.train.seq_len", "Training seq len", number({placeholder: "calibration's"})),
    field("distill.eval.source", "Evaluation data", text({list: "source-list", placeholder: "the training source"})),
    field("distill.eval.sequences", "Evaluation blocks", number({placeholder: "16"})),
    field("distill.recipe.lr", "Peak lr", number({placeholder: "5e-5"})),
    field("distill.recipe.min_lr", "Final lr", number({placeholder: "5e-6"})),
    field("distill.recipe.warmup_steps", "Warm-up steps", number({placeholder: "100"})),
    field("distill.recipe.batch_size", "Batch (sequences)", number({placeholder: "16"})),
    field("distill.recipe.micro_batch_size", "Micro-batch", number({placeholder: "4"})),
    field("distill.recipe.eval_every", "Evaluate every", number({placeholder: "100"}), "steps; also at step 0 and the last"));
  const distillFieldset = h("fieldset", {class: "distill"},
    h("legend", {}, "Distillation"),
    field("distill", "Distil the DTP model of some layouts after the export (stage distilling)", distillToggle),
    distillSection);

  const form = h("form", {id: "submit-form", novalidate: true},
    h("fieldset", {}, h("legend", {}, "Model"), h("div", {class: "grid"},
      field("model.id", "Model", text({list: "model-list", required: true, placeholder: "a name under the model root, or owner/name"}),
        "a checkpoint directory or .gguf under the server's model root, or a hub id"),
      field("model.gguf_file", "GGUF file", text({list: "gguf-list", placeholder: "optional"})),
      field("model.revision", "Revision", text({placeholder: "hub models only"})),
      field("model.dtype", "dtype", select([["float32", "float32"], ["bfloat16", "bfloat16"], ["float16", "float16"]])))),
    h("fieldset", {}, h("legend", {}, "Layout"), h("div", {class: "grid"},
      field("devices", "Devices L", number({required: true}), "must divide the KV groups and the FFN width"),
      field("delta", "Delay δ", number(), "in modules"),
      field("score", "Up-edge score", select([["fo", "fo (first order)"], ["add", "add"]])),
      field("random_layouts", "Random layouts", number(), "baselines random-1000 …"),
      field("ablations", "Ablations (the paper's seven spread layouts)", check()))),
    h("fieldset", {}, h("legend", {}, "Calibration"), h("div", {class: "grid"},
      field("calibration.source", "Source", text({list: "source-list", required: true}),
        "corpus:NAME, hf:NAME[:CONFIG[:SPLIT]] or a name under the data root"),
      field("calibration.sequences", "Sequences", number()),
      field("calibration.seq_len", "Tokens per sequence", number()),
      field("calibration.seed", "Seed", number({placeholder: "0"})))),
    h("fieldset", {}, h("legend", {}, "Outputs"), h("div", {class: "grid"},
      field("export.checkpoint", "Permuted checkpoint (checkpoint/)", check()),
      field("export.shards", "Per-rank shards (shards/)", check()),
      field("restarts", "Optimiser restarts", number({placeholder: "4"})),
      field("batch_size", "Calibration micro-batch", number({placeholder: "4"})))),
    distillFieldset,
    general,
    h("div", {class: "actions"}, submitButton),
    h("details", {class: "request"}, h("summary", {}, "The request as JSON and curl"), preview,
      h("div", {class: "curl-head"}, h("span", {class: "muted"}, "curl"), copyHost), curl),
    modelList, ggufList, sourceList);

  container.append(h("section", {class: "card"}, h("div", {class: "card-head"}, h("h1", {}, "Submit a job")), form));

  function setValues(values) {
    for (const [path, value] of Object.entries(values)) {
      const input = inputs[path];
      if (!input) continue;
      if (input.type === "checkbox") input.checked = Boolean(value);
      else input.value = value === null || value === undefined ? "" : String(value);
    }
  }

  let chosenLayouts = new Set(["optimised", "contiguous"]);
  function layoutNames() {
    const k = Number(inputs.random_layouts.value) || 0;
    const names = ["optimised"];
    if (inputs.ablations.checked) {
      names.push(...ABLATIONS.map((n) => (n === "add-score" && inputs.score.value === "add" ? "fo-score" : n)));
      const restarts = inputs.restarts.value === "" ? RESTARTS_DEFAULT : Number(inputs.restarts.value);
      if (restarts > 0) names.push("optimised-restarts-0");
    }
    names.push("contiguous");
    for (let i = 0; i < Math.min(Math.max(0, k), 64); i += 1) names.push(`random-${RANDOM_SEED_BASE + i}`);
    return names;
  }
  function drawLayoutChecks() {
    replace(layoutBox, layoutNames().map((name) => {
      const box = h("input", {type: "checkbox", value: name, id: `f-layout-${name}`, checked: chosenLayouts.has(name)});
      box.addEventListener("change", () => {
        if (box.checked) chosenLayouts.add(name); else chosenLayouts.delete(name);
        update();
      });
      return h("label", {class: "inline", for: box.id}, box, " ", name);
    }));
  }

  function spec() {
    const v = (p) => inputs[p].value.trim();
    const out = {model: {id: v("model.id")}, devices: numeric(v("devices")), calibration: {source: v("calibration.source")}};
    if (v("model.gguf_file")) out.model.gguf_file = v("model.gguf_file");
    if (v("model.revision")) out.model.revision = v("model.revision");
    out.model.dtype = v("model.dtype");
    for (const p of ["delta", "random_layouts", "restarts", "batch_size"]) if (numeric(v(p)) !== undefined) out[p] = numeric(v(p));
    out.score = v("score");
    out.ablations = inputs.ablations.checked;
    for (const p of ["sequences", "seq_len", "seed"]) {
      const n = numeric(v(`calibration.${p}`));
      if (n !== undefined) out.calibration[p] = n;
    }
    out.export = {checkpoint: inputs["export.checkpoint"].checked, shards: inputs["export.shards"].checked};
    if (inputs.distill.checked) {
      const names = layoutNames().filter((n) => chosenLayouts.has(n));
      const d = {layouts: names};
      const seeds = v("distill.seeds");
      if (seeds) d.seeds = seeds.split(",").map((x) => x.trim()).filter(Boolean).map((x) => numeric(x));
      if (numeric(v("distill.steps")) !== undefined) d.steps = numeric(v("distill.steps"));
      for (const part of ["train", "eval"]) {
        const data = {};
        if (v(`distill.${part}.source`)) data.source = v(`distill.${part}.source`);
        for (const k of ["seq_len", "sequences"]) {
          const p = `distill.${part}.${k}`;
          if (inputs[p] && numeric(v(p)) !== undefined) data[k] = numeric(v(p));
        }
        if (Object.keys(data).length) {
          // a block without a source reads the default source (the calibration's, or the training's)
          if (!data.source) data.source = part === "train" ? out.calibration.source : (d.train && d.train.source) || out.calibration.source;
          d[part] = data;
        }
      }
      const recipe = {};
      for (const k of ["lr", "min_lr", "warmup_steps", "batch_size", "micro_batch_size", "eval_every"]) {
        const n = numeric(v(`distill.recipe.${k}`));
        if (n !== undefined) recipe[k] = n;
      }
      if (Object.keys(recipe).length) d.recipe = recipe;
      out.distill = d;
    }
    return out;
  }

  function update() {
    distillSection.hidden = !inputs.distill.checked;
    const body = JSON.stringify(spec(), null, 2);
    preview.textContent = body;
    const key = getKey() ? " -H \"X-API-Key: $DTP_LAYOUT_API_KEY\"" : "";
    const command = `curl -s -X POST '${apiUrl("v1/jobs").href}' -H 'Content-Type: application/json'${key} \\\n  -d '${JSON.stringify(spec()).replace(/'/g, "'\\''")}'`;
    curl.textContent = command;
    replace(copyHost, copyButton(command));
  }

  function clearErrors() {
    for (const el of Object.values(errors)) el.textContent = "";
    for (const g of Object.values(groups)) g.classList.remove("has-error");
    general.hidden = true;
    replace(general);
  }

  /** The form field an API field path belongs to: itself or its longest known prefix. */
  function target(path) {
    const parts = path.split(".");
    for (let n = parts.length; n > 0; n -= 1) {
      const p = parts.slice(0, n).join(".");
      if (errors[p]) return p;
    }
    return null;
  }

  function showErrors(err) {
    const loose = [];
    let first = null;
    for (const [path, messages] of Object.entries(err.fields)) {
      const t = target(path);
      if (t === null) { loose.push(`${path}: ${messages.join("; ")}`); continue; }
      const prefix = t === path ? "" : `${path.slice(t.length + 1)}: `;
      const existing = errors[t].textContent;
      errors[t].textContent = (existing ? `${existing} ` : "") + messages.map((m) => prefix + m).join(" ");
      groups[t].classList.add("has-error");
      if (!groups[t].closest("[hidden]")) first = first || groups[t];
    }
    const count = Object.values(err.fields).reduce((a, m) => a + m.length, 0);
    general.hidden = false;
    replace(general, h("strong", {}, count ? `The service refused the job (${count} problem${count === 1 ? "" : "s"}).`
      : `The service refused the job: ${err.message}`), loose.length ? h("ul", {}, loose.map((l) => h("li", {}, l))) : null);
    const focus = first && first.querySelector("input, select");
    if (focus) focus.focus();
  }

  form.addEventListener("input", (ev) => {
    if ([inputs.random_layouts, inputs.ablations, inputs.score, inputs.restarts].includes(ev.target)) drawLayoutChecks();
    if (ev.target === inputs["model.id"]) fillGguf();
    update();
  });
  form.addEventListener("change", update);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    clearErrors();
    submitButton.disabled = true;
    submitButton.textContent = "Submitting…";
    try {
      const job = await api("v1/jobs", {method: "POST", body: spec()});
      navigate(`jobs/${job.id}`);
    } catch (err) {
      if (err instanceof ApiError && err.status !== 401) showErrors(err);
      else if (!(err instanceof ApiError)) showErrors(new ApiError(0, {detail: String(err)}));
    } finally {
      submitButton.disabled = false;
      submitButton.textContent = "Submit job";
    }
  });

  // the model root's names, for the datalist and a sensible default
  let catalogue = [];
  function fillGguf() {
    const entry = catalogue.find((m) => m.id === inputs["model.id"].value.trim());
    replace(ggufList, ((entry && entry.gguf_files) || []).map((f) => h("option", {value: f})));
    if (entry && entry.gguf_files && entry.gguf_files.length && !inputs["model.gguf_file"].value) {
      inputs["model.gguf_file"].value = entry.gguf_files[0];
    }
  }

  setValues(DEFAULTS);
  drawLayoutChecks();
  update();

  (async () => {
    const from = params.get("from");
    if (from) {
      try {
        const job = await api(`v1/jobs/${encodeURIComponent(from)}`);
        prefill(job.spec || {});
        return;
      } catch (err) {
        general.hidden = false;
        general.textContent = `Cannot load job ${from}: ${err.message}`;
      }
    }
    try {
      catalogue = (await api("ui/api/models")).items || [];
    } catch {
      catalogue = [];
    }
    replace(modelList, catalogue.map((m) => h("option", {value: m.id})));
    if (!inputs["model.id"].value && catalogue.length) {
      const preferred = catalogue.find((m) => m.id === "smollm2-135m") || catalogue[0];
      inputs["model.id"].value = preferred.id;
      fillGguf();
      update();
    }
  })();

  function prefill(sp) {
    const values = {...DEFAULTS};
    const m = sp.model || {};
    Object.assign(values, {"model.id": m.id, "model.gguf_file": m.gguf_file, "model.revision": m.revision,
                           "model.dtype": m.dtype || "float32"});
    for (const k of ["devices", "delta", "score", "random_layouts", "restarts", "batch_size"]) if (sp[k] !== undefined) values[k] = sp[k];
    values.ablations = Boolean(sp.ablations);
    for (const k of ["source", "sequences", "seq_len", "seed"]) {
      if (sp.calibration && sp.calibration[k] !== undefined) values[`calibration.${k}`] = sp.calibration[k];
    }
    const ex = sp.export === false ? {checkpoint: false, shards: false} : sp.export || {};
    values["export.checkpoint"] = ex.checkpoint !== false;
    values["export.shards"] = ex.shards !== false;
    const d = sp.distill;
    values.distill = Boolean(d);
    if (d) {
      chosenLayouts = new Set(d.layouts || []);
      values["distill.seeds"] = (d.seeds || [0]).join(",");
      values["distill.steps"] = d.steps ?? (d.recipe && d.recipe.steps) ?? "";
      for (const part of ["train", "eval"]) {
        values[`distill.${part}.source`] = (d[part] && d[part].source) || "";
      }
      values["distill.train.seq_len"] = (d.train && d.train.seq_len) ?? "";
      values["distill.eval.sequences"] = (d.eval && d.eval.sequences) ?? "";
      for (const k of ["lr", "min_lr", "warmup_steps", "batch_size", "micro_batch_size", "eval_every"]) {
        values[`distill.recipe.${k}`] = (d.recipe && d.recipe[k]) ?? "";
      }
    }
    setValues(values);
    drawLayoutChecks();
    update();
  }

  return null;
}
