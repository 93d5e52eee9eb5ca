// Submit form: every field of the job spec; the API's 422 messages are shown next to their fields.
// What the form starts from is the server's (GET /v1/spec): the spec's defaults, each field's choices
// (dtypes, scores), the random layouts' seed base, the corpora and data this server has, and an example
// job it can run; nothing here restates a default or a list of names.

import {api, ApiError, apiUrl, getKey} from "../api.js";
import {copyButton, h, replace} from "../dom.js";

const OTHER_SOURCE = "";  // the source select's last option: type hf:… or a data-root name

const idOf = (path) => `f-${path.replace(/\./g, "-")}`;

/** {"a": {"b": 1}} → {"a.b": 1}; lists stay values. */
function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    if (v !== null && typeof v === "object" && !Array.isArray(v)) flatten(v, `${prefix}${k}.`, out);
    else out[`${prefix}${k}`] = v;
  }
  return out;
}

/** A number field's value: a number, undefined when blank, or the raw text (the API names the problem). */
function numeric(text) {
  const t = text.trim();
  if (t === "") return undefined;
  const n = Number(t);
  return Number.isFinite(n) ? n : t;
}

/** The value at a dotted path of a spec (undefined where a part is missing or not an object). */
function valueAt(obj, path) {
  let node = obj;
  for (const part of path.split(".")) {
    if (node === null || typeof node !== "object" || Array.isArray(node)) return undefined;
    node = node[part];
  }
  return node;
}

/** Sets obj's dotted path, making the objects on the way. */
function setPath(obj, path, value) {
  const parts = path.split(".");
  let node = obj;
  for (const part of parts.slice(0, -1)) {
    if (node[part] === null || typeof node[part] !== "object" || Array.isArray(node[part])) node[part] = {};
    node = node[part];
  }
  node[parts[parts.length - 1]] = value;
}

/** "≥ 1, ≤ 64" from a declared field's bounds ("" when it has none). */
function boundsText(declared) {
  const marks = [["ge", "≥"], ["gt", ">"], ["le", "≤"], ["lt", "<"]];
  return marks.filter(([k]) => declared[k] !== undefined).map(([k, mark]) => `${mark} ${declared[k]}`).join(", ");
}

export function renderSubmit(container, {params, navigate}) {
  document.title = "Submit · dtp-layout";
  const inputs = {};
  const errors = {};
  const groups = {};

  function field(path, label, input, hint, extra) {
    input.id = input.id || idOf(path);
    input.name = path;
    inputs[path] = input;
    errors[path] = h("p", {class: "field-error", "data-error-for": path, role: "alert"});
    groups[path] = h("div", {class: ["field", input.type === "checkbox" && "check"], "data-field": path},
      input.type === "checkbox" ? h("label", {for: input.id, class: "inline"}, input, " ", label)
        : [h("label", {for: input.id}, label), input],
      extra || null, hint ? h("small", {class: "hint"}, hint) : null, errors[path]);
    return groups[path];
  }
  const text = (attrs = {}) => h("input", {type: "text", autocomplete: "off", spellcheck: "false", ...attrs});
  const number = (attrs = {}) => text({inputmode: "decimal", class: "num-input", ...attrs});
  const check = () => h("input", {type: "checkbox"});
  const select = (options) => h("select", {}, options.map(([v, l]) => h("option", {value: v}, l)));

  const modelList = h("datalist", {id: "model-list"});
  const ggufList = h("datalist", {id: "gguf-list"});
  const sourceList = h("datalist", {id: "source-list"});  // the server's sources, for the distillation's
  // The calibration source: what this server has, or another one typed in (hf:…, a data-root name).
  const sourceSelect = h("select", {}, h("option", {value: OTHER_SOURCE}, "other (type it below)"));
  const sourceOther = text({id: "f-calibration-source-other", "aria-label": "Other calibration source",
                            placeholder: "hf:OWNER/NAME[:CONFIG[:SPLIT]] or a name under the data root"});
  const layoutBox = h("div", {class: "checks", id: "distill-layouts"});
  const layoutError = h("p", {class: "field-error", "data-error-for": "distill.layouts", role: "alert"});
  errors["distill.layouts"] = layoutError;
  groups["distill.layouts"] = h("div", {class: "field wide", "data-field": "distill.layouts"},
    h("span", {class: "label"}, "Layouts to distil"), layoutBox, layoutError);
  const general = h("div", {class: "error-box", id: "submit-errors", hidden: true, role: "alert"});
  const preview = h("pre", {class: "code", id: "spec-json"});
  const curl = h("pre", {class: "code", id: "spec-curl"});
  const copyHost = h("span", {});
  const submitButton = h("button", {type: "submit", id: "submit-job", disabled: true}, "Submit job");

  const distillToggle = check();
  // The declared fields not laid out here by hand: drawn from GET /v1/spec's `fields` once it has come,
  // by their kind, grouped by their parent path; the distillation's inside its section (sent only with it).
  const moreFields = h("details", {class: "more", id: "more-fields", hidden: true}, h("summary", {}, "More fields"));
  const moreDistill = h("details", {class: "more", id: "more-distill-fields", hidden: true},
    h("summary", {}, "More distillation fields"));
  const generated = {};  // path → its declared field (GET /v1/spec `fields`), for the fields drawn from it
  const touched = new Set();  // generated checkboxes and selects the user (or the prefilled spec) set

  const distillSection = h("div", {class: "grid", id: "distill-fields"},
    groups["distill.layouts"],
    field("distill.seeds", "Training seeds", text(), "comma-separated; each (layout, seed) is one run"),
    field("distill.steps", "Steps", number(), "optimiser steps per run"),
    field("distill.train.source", "Training data", text({list: "source-list", placeholder: "the calibration source"})),
    field("distill.train.seq_len", "Training seq len", number({placeholder: "calibration's"})),
    field("distill.eval.source", "Evaluation data", text({list: "source-list", placeholder: "the training source"})),
    field("distill.eval.sequences", "Evaluation blocks", number()),
    field("distill.recipe.lr", "Peak lr", number()),
    field("distill.recipe.min_lr", "Final lr", number()),
    field("distill.recipe.warmup_steps", "Warm-up steps", number()),
    field("distill.recipe.batch_size", "Batch (sequences)", number()),
    field("distill.recipe.micro_batch_size", "Micro-batch", number()),
    field("distill.recipe.eval_every", "Evaluate every", number(), "steps; also at step 0 and the last"),
    moreDistill);
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
      field("model.dtype", "dtype", select([])))),  // the choices: the declared field's, from /v1/spec
    h("fieldset", {}, h("legend", {}, "Layout"), h("div", {class: "grid"},
      field("devices", "Devices L", number({required: true}), "must divide the KV groups and the FFN width"),
      field("delta", "Delay δ", number(), "in modules"),
      field("score", "Up-edge score", select([])),
      field("random_layouts", "Random layouts", number(), "random baselines"),
      field("ablations", "Ablations (the paper's seven spread layouts)", check()),
      field("stability", "Stability (optimise on each half of the calibration blocks)", check()))),
    h("fieldset", {}, h("legend", {}, "Calibration"), h("div", {class: "grid"},
      field("calibration.source", "Source", sourceSelect,
        "the corpora and data this server has; or other: hf:OWNER/NAME[:CONFIG[:SPLIT]] or a name under the data root",
        sourceOther),
      field("calibration.sequences", "Sequences", number()),
      field("calibration.seq_len", "Tokens per sequence", number()),
      field("calibration.seed", "Seed", number()))),
    h("fieldset", {}, h("legend", {}, "Outputs"), h("div", {class: "grid"},
      field("export.checkpoint", "Permuted checkpoint (checkpoint/)", check()),
      field("export.shards", "Per-rank shards (shards/)", check()),
      field("restarts", "Optimiser restarts", number()),
      field("batch_size", "Calibration micro-batch", number()))),
    moreFields,
    distillFieldset,
    general,
    h("div", {class: "actions"}, submitButton),
    h("details", {class: "request"}, h("summary", {}, "The request as JSON and curl"), preview,
      h("div", {class: "curl-head"}, h("span", {class: "muted"}, "curl"), copyHost), curl),
    modelList, ggufList, sourceList);

  container.append(h("section", {class: "card"}, h("div", {class: "card-head"}, h("h1", {}, "Submit a job")), form));

  /** An input for a declared field by its kind: a list (and the betas pair) is comma-separated text. */
  function declaredInput(declared) {
    if (declared.kind === "bool") return check();
    if (declared.kind === "choice") return select((declared.choices || []).map((c) => [c, c]));
    if (declared.kind === "int" || declared.kind === "float") return number();
    return text();
  }

  /** Draws every declared field the form does not already have, each group under its parent path. */
  function drawGenerated(fields) {
    const byGroup = new Map();
    for (const declared of fields) {
      if (inputs[declared.path] || errors[declared.path]) continue;  // laid out by hand above
      generated[declared.path] = declared;
      const group = declared.path.includes(".") ? declared.path.slice(0, declared.path.lastIndexOf(".")) : "";
      const list = declared.kind === "list" || declared.kind === "betas" ? "comma-separated" : "";
      const hint = [declared.doc, boundsText(declared), list].filter(Boolean).join(" · ");
      const leaf = declared.path.slice(group ? group.length + 1 : 0);
      if (!byGroup.has(group)) byGroup.set(group, []);
      byGroup.get(group).push(field(declared.path, leaf, declaredInput(declared), hint));
    }
    for (const [group, drawn] of byGroup) {
      const host = group === "distill" || group.startsWith("distill.") ? moreDistill : moreFields;
      host.append(h("fieldset", {class: "group", "data-group": group},
        h("legend", {}, group || "job"), h("div", {class: "grid"}, drawn)));
    }
    moreFields.hidden = !moreFields.querySelector("fieldset");
    moreDistill.hidden = !moreDistill.querySelector("fieldset");
  }

  /** A generated field's value to send: undefined when left untouched (the server fills in its default). */
  function declaredValue(declared) {
    const input = inputs[declared.path];
    if (declared.kind === "bool") return touched.has(declared.path) ? input.checked : undefined;
    if (declared.kind === "choice") return touched.has(declared.path) ? input.value : undefined;
    const t = input.value.trim();
    if (t === "") return undefined;
    if (declared.kind === "int" || declared.kind === "float") return numeric(t);
    if (declared.kind === "list" || declared.kind === "betas") {
      const items = t.split(",").map((x) => x.trim()).filter(Boolean);
      const itemKind = declared.kind === "betas" ? "float" : (declared.item || {}).kind;
      return itemKind === "int" || itemKind === "float" ? items.map((x) => numeric(x)) : items;
    }
    return t;
  }

  /** The touched generated fields under `prefix` into obj, at their paths less the prefix. */
  function putGenerated(obj, prefix, inside) {
    for (const [path, declared] of Object.entries(generated)) {
      if (path.startsWith(prefix) !== inside) continue;
      const value = declaredValue(declared);
      if (value !== undefined) setPath(obj, inside ? path.slice(prefix.length) : path, value);
    }
  }

  // GET /v1/spec: defaults, sources, the example job and the layout names (null until it has come).
  let info = null;
  let defaults = {};  // "calibration.sequences" → 64, "distill.recipe.lr" → 5e-5, …

  function setSource(value) {
    const known = [...sourceSelect.options].some((o) => o.value === value && value !== OTHER_SOURCE);
    sourceSelect.value = known ? value : OTHER_SOURCE;
    sourceOther.value = known ? "" : value;
    sourceOther.hidden = known;
  }

  function setValues(values) {
    for (const [path, value] of Object.entries(values)) {
      const input = inputs[path];
      if (!input) continue;
      if (path === "calibration.source") setSource(value === null || value === undefined ? "" : String(value));
      else if (input.type === "checkbox") input.checked = Boolean(value);
      else input.value = value === null || value === undefined ? "" : Array.isArray(value) ? value.join(",") : String(value);
    }
  }

  /** Every field to its default: checkboxes and selects take it, a blank text field shows it as its
   *  placeholder (left blank, the server applies it). */
  function showDefaults() {
    touched.clear();
    for (const [path, input] of Object.entries(inputs)) {
      const d = defaults[path];
      if (d === undefined || d === null) continue;
      if (input.type === "checkbox") input.checked = Boolean(d);
      else if (input.tagName === "SELECT" && path !== "calibration.source") input.value = String(d);
      else if (input.tagName !== "SELECT") { input.value = ""; input.placeholder = Array.isArray(d) ? d.join(",") : String(d); }
    }
  }

  let chosenLayouts = new Set();
  function layoutNames() {
    if (!info) return [];
    const k = Number(inputs.random_layouts.value) || 0;
    const names = ["optimised"];
    if (inputs.ablations.checked) {
      const restarts = inputs.restarts.value === "" ? defaults.restarts : Number(inputs.restarts.value);
      const byScore = info.ablations[inputs.score.value] || info.ablations[defaults.score];
      names.push(...(restarts > 0 ? byScore.restarts : byScore.paper));
    }
    names.push("contiguous");
    for (let i = 0; i < Math.min(Math.max(0, k), 64); i += 1) names.push(`random-${info.random_seed_base + i}`);
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
    const source = sourceSelect.value === OTHER_SOURCE ? sourceOther.value.trim() : sourceSelect.value;
    const out = {model: {id: v("model.id")}, devices: numeric(v("devices")), calibration: {source}};
    if (v("model.gguf_file")) out.model.gguf_file = v("model.gguf_file");
    if (v("model.revision")) out.model.revision = v("model.revision");
    out.model.dtype = v("model.dtype");
    for (const p of ["delta", "random_layouts", "restarts", "batch_size"]) if (numeric(v(p)) !== undefined) out[p] = numeric(v(p));
    out.score = v("score");
    out.ablations = inputs.ablations.checked;
    if (inputs.stability.checked) out.stability = true;
    for (const p of ["sequences", "seq_len", "seed"]) {
      const n = numeric(v(`calibration.${p}`));
      if (n !== undefined) out.calibration[p] = n;
    }
    out.export = {checkpoint: inputs["export.checkpoint"].checked, shards: inputs["export.shards"].checked};
    putGenerated(out, "distill.", false);
    if (inputs.distill.checked) {
      const names = layoutNames().filter((n) => chosenLayouts.has(n));
      const d = {layouts: names};
      putGenerated(d, "distill.", true);
      const seeds = v("distill.seeds");
      if (seeds) d.seeds = seeds.split(",").map((x) => x.trim()).filter(Boolean).map((x) => numeric(x));
      if (numeric(v("distill.steps")) !== undefined) d.steps = numeric(v("distill.steps"));
      for (const part of ["train", "eval"]) {
        const data = {...(d[part] || {})};
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
      const recipe = {...(d.recipe || {})};
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
      const more = groups[t].closest("details.more");
      if (more) more.open = true;  // a generated field's message: its section opens to show it
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
    if (generated[ev.target.name]) touched.add(ev.target.name);
    if ([inputs.random_layouts, inputs.ablations, inputs.score, inputs.restarts].includes(ev.target)) drawLayoutChecks();
    if (ev.target === inputs["model.id"]) fillGguf();
    if (ev.target === sourceSelect) {
      sourceOther.hidden = sourceSelect.value !== OTHER_SOURCE;
      if (!sourceOther.hidden) sourceOther.focus();
    }
    update();
  });
  form.addEventListener("change", (ev) => {
    if (generated[ev.target.name]) touched.add(ev.target.name);
    update();
  });
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

  // the model root's names, for the datalist and the form's model
  let catalogue = null;
  function fillGguf() {
    const entry = (catalogue || []).find((m) => m.id === inputs["model.id"].value.trim());
    const files = (entry && entry.gguf_files) || [];
    replace(ggufList, files.map((f) => h("option", {value: f})));
    // another model of the root: its own .gguf file (or none), never the previous model's
    if (entry && !files.includes(inputs["model.gguf_file"].value.trim())) inputs["model.gguf_file"].value = files[0] || "";
  }

  drawLayoutChecks();
  update();

  (async () => {
    const models = api("ui/api/models").then((r) => r.items || [], () => null);
    try {
      info = await api("v1/spec");
    } catch (err) {
      // 401: the key prompt is up, or a key was entered after this request went out; either way the key
      // dialog draws the page again once the key works
      if (err instanceof ApiError && err.status === 401) return;
      general.hidden = false;
      general.textContent = `Cannot read this service's defaults (GET /v1/spec): ${err.message}`;
      submitButton.disabled = false;
      return;
    }
    catalogue = await models;
    defaults = {...flatten(info.defaults), ...flatten(info.distill_defaults, "distill.")};
    drawGenerated(info.fields);
    for (const [path, declared] of Object.entries(generated)) defaults[path] ??= declared.default;
    // the selects' options are the declared fields' choices; the hints name what the server names
    for (const declared of info.fields) {
      const input = inputs[declared.path];
      if (input && input.tagName === "SELECT" && declared.choices) {
        replace(input, declared.choices.map((c) => h("option", {value: c}, c)));
      }
    }
    groups.random_layouts.querySelector(".hint").textContent = `baselines random-${info.random_seed_base} …`;
    defaults["distill.steps"] ??= defaults["distill.recipe.steps"];  // `steps` is the recipe's, given once
    sourceSelect.prepend(...info.sources.map((src) => h("option", {value: src.source},
      src.kind === "corpus" ? `${src.source} (${src.description})` : `${src.source} (data root)`)));
    replace(sourceList, info.sources.map((src) => h("option", {value: src.source})));
    replace(modelList, (catalogue || []).map((m) => h("option", {value: m.id})));

    const from = params.get("from");
    let shown = false;
    if (from) {
      try {
        const job = await api(`v1/jobs/${encodeURIComponent(from)}`);
        prefill(job.spec || {});
        shown = true;
      } catch (err) {
        general.hidden = false;
        general.textContent = `Cannot load job ${from}: ${err.message}`;
      }
    }
    if (!shown) prefill(runnableExample());
    submitButton.disabled = false;
  })();

  /** The server's example job, on a model of this server's model root: the example's own where the
   *  root has it, else the root's first model. */
  function runnableExample() {
    const example = structuredClone(info.example);
    const model = example.model || {};
    if (catalogue !== null && !catalogue.some((m) => m.id === model.id)) {
      const first = catalogue[0];
      example.model = first ? {id: first.id, gguf_file: first.gguf_files[0], dtype: model.dtype} : {dtype: model.dtype};
    }
    return example;
  }

  /** Show a spec (the example, or the job of ?from=ID) over the defaults; the distillation fields start
   *  from the server's distillation example unless the spec has its own. */
  function prefill(sp) {
    showDefaults();
    const quick = info.distill_example || {};
    chosenLayouts = new Set(quick.layouts || []);
    const values = flatten({...quick, layouts: null}, "distill.");
    const put = (path, value) => { if (value !== undefined && value !== null) values[path] = value; };
    const m = sp.model || {};
    for (const k of ["id", "gguf_file", "revision", "dtype"]) put(`model.${k}`, m[k]);
    for (const k of ["devices", "delta", "score", "random_layouts", "restarts", "batch_size", "ablations", "stability"]) put(k, sp[k]);
    for (const k of ["source", "sequences", "seq_len", "seed"]) put(`calibration.${k}`, (sp.calibration || {})[k]);
    if (sp.export !== undefined && sp.export !== null) {
      const ex = sp.export === false ? {checkpoint: false, shards: false} : sp.export;
      put("export.checkpoint", ex.checkpoint);
      put("export.shards", ex.shards);
    }
    const d = sp.distill;
    values.distill = Boolean(d);
    if (d) {
      chosenLayouts = new Set(d.layouts || []);
      values["distill.seeds"] = d.seeds || "";
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
    // The generated fields: the spec's value where it has one (a distillation's: its own, else the example's).
    for (const path of Object.keys(generated)) {
      if (path === "distill.recipe.steps") { delete values[path]; continue; }  // shown as distill.steps: given once
      const own = !path.startsWith("distill.") ? valueAt(sp, path) : d ? valueAt(d, path.slice(8)) : values[path];
      if (own === undefined || own === null) delete values[path];
      else { values[path] = own; touched.add(path); }
    }
    // A distillation source that is the one it defaults to (training: the calibration's, evaluation: the
    // training's) is left blank, so that it follows the calibration source when that is changed.
    const trainSource = values["distill.train.source"] || values["calibration.source"];
    if (values["distill.train.source"] === values["calibration.source"]) values["distill.train.source"] = "";
    if (values["distill.eval.source"] === trainSource) values["distill.eval.source"] = "";
    setValues(values);
    fillGguf();
    drawLayoutChecks();
    update();
  }

  return null;
}
