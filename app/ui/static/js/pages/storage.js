// Storage: what the tenant keeps (GET /v1/usage: bytes by kind against its quota), its uploads (each with
// a Delete button) and a form that uploads files part by part (POST /v1/uploads, PUT …/parts/N, complete).

import {api, apiPut, sha256Hex} from "../api.js";
import {bytes, copyButton, h, progressBar, replace, shortId, when} from "../dom.js";

const KIND_NAMES = {uploads_model: "model uploads", uploads_data: "data uploads", artifacts: "job artifacts",
                    reserved: "reserved by running jobs", converted: "converted models", affinity: "affinity cache"};

function usageCard(usage) {
  const quota = usage.quota_bytes;
  const share = quota ? Math.min(1, usage.used_bytes / quota) : 0;
  return [
    h("div", {class: "card-head"}, h("h1", {}, "Storage"),
      h("span", {class: "muted", id: "usage-total"},
        `${bytes(usage.used_bytes)} used` + (quota ? ` of ${bytes(quota)} (${(100 * share).toFixed(1)}%)` : " (no quota)"))),
    quota ? progressBar(share, `storage: ${(100 * share).toFixed(1)}% of the quota`) : null,
    h("dl", {class: "meta", id: "usage-bytes"},
      Object.entries(usage.bytes).map(([k, v]) => [h("dt", {}, KIND_NAMES[k] || k), h("dd", {}, bytes(v))]),
      h("dt", {}, "Uploads"), h("dd", {}, `${usage.counts.uploads_complete} complete, ${usage.counts.uploads_open} open`),
      h("dt", {}, "Jobs"), h("dd", {}, `${usage.counts.jobs} (${usage.counts.jobs_expired} with their artifacts removed)`),
      h("dt", {}, "Retention"), h("dd", {}, usage.retention_days
        ? `finished jobs' artifacts are removed after ${usage.retention_days} days` : "kept until deleted")),
  ];
}

function uploadsTable(items, onDelete) {
  if (!items.length) return h("p", {class: "muted", id: "no-uploads"}, "No uploads yet.");
  return h("div", {class: "table-wrap"}, h("table", {id: "uploads"},
    h("thead", {}, h("tr", {}, h("th", {}, "Name"), h("th", {}, "Kind"), h("th", {}, "Status"), h("th", {class: "num"}, "Size"),
      h("th", {}, "Name it in a job as"), h("th", {class: "hide-narrow"}, "Created"), h("th", {}, ""))),
    h("tbody", {}, items.map((u) => h("tr", {"data-upload": u.id},
      h("td", {}, u.name), h("td", {}, u.kind), h("td", {}, u.status === "complete" ? "complete"
        : `open (${bytes(u.received_bytes)} of ${bytes(u.size)})`),
      h("td", {class: "num"}, bytes(u.size)),
      h("td", {}, h("code", {}, `upload:${shortId(u.id)}…`), " ", copyButton(u.ref, "copy")),
      h("td", {class: "hide-narrow nowrap"}, when(u.created_at)),
      h("td", {}, h("button", {type: "button", class: "small danger", "data-delete-upload": u.id,
                               onclick: () => onDelete(u)}, "Delete")))))));
}

async function sendFiles(kind, name, files, report) {
  const declared = [];
  for (const f of files) {
    report(`hashing ${f.name}…`, 0);
    const sha256 = await sha256Hex(f);
    if (sha256 === null) throw new Error("this browser cannot compute sha256 here (it needs https or localhost); use `dtp-layout client upload`");
    declared.push({path: f.name, size: f.size, sha256});
  }
  const upload = await api("v1/uploads", {method: "POST", body: {kind, name, files: declared}});
  const total = files.reduce((n, f) => n + f.size, 0);
  let sent = 0;
  for (const f of files) {
    const state = upload.files.find((x) => x.path === f.name);
    for (let n = 1; n <= state.parts; n++) {
      const part = f.slice((n - 1) * upload.part_size, n * upload.part_size);
      await apiPut(`v1/uploads/${upload.id}/files/${encodeURIComponent(f.name)}/parts/${n}`, part);
      sent += part.size;
      report(`sending ${f.name}: part ${n} of ${state.parts}`, total ? sent / total : 1);
    }
  }
  report("verifying…", 1);
  return api(`v1/uploads/${upload.id}/complete`, {method: "POST"});
}

function uploadForm(onDone) {
  const status = h("p", {class: "muted", id: "upload-status", role: "status"});
  const bar = h("div", {});
  const input = h("input", {type: "file", id: "upload-files", multiple: true});
  const kind = h("select", {id: "upload-kind"}, h("option", {value: "data"}, "data (.txt, .jsonl, .npy of token ids)"),
    h("option", {value: "model"}, "model (config.json, *.safetensors, tokenizer files; or one .gguf)"));
  const name = h("input", {type: "text", id: "upload-name", maxlength: 100, placeholder: "a label (default: the first file's name)"});
  const button = h("button", {type: "submit", id: "upload-send"}, "Upload");
  const form = h("form", {id: "upload-form", class: "stack"},
    h("label", {for: "upload-kind"}, "Kind"), kind, h("label", {for: "upload-files"}, "Files"), input,
    h("label", {for: "upload-name"}, "Name"), name, h("div", {class: "actions"}, button), bar, status,
    h("p", {class: "muted"}, "Large files and resuming after an interruption: ", h("code", {}, "dtp-layout client upload PATH"), "."));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const files = Array.from(input.files || []);
    if (!files.length) { status.textContent = "Choose a file or the files of a model directory."; return; }
    button.disabled = true;
    try {
      const done = await sendFiles(kind.value, name.value.trim() || files[0].name.replace(/[^A-Za-z0-9_.+=@ -]/g, "_"),
        files, (text, fraction) => { status.textContent = text; replace(bar, progressBar(fraction, text)); });
      status.textContent = `Complete: name it in a job as ${done.ref}`;
      replace(bar);
      onDone();
    } catch (err) {
      status.textContent = `Refused: ${err.message}`;
      status.classList.add("field-error");
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

export function renderStorage(container) {
  document.title = "Storage · dtp-layout";
  const usage = h("section", {class: "card", id: "usage"}, h("p", {class: "muted"}, "Loading…"));
  const list = h("section", {class: "card", id: "uploads-card"}, h("h2", {}, "Uploads"));
  const listBody = h("div", {});
  list.append(listBody);
  const form = h("section", {class: "card"}, h("h2", {}, "Upload"));
  container.append(usage, list, form);

  async function load() {
    try {
      const [u, {items, total}] = await Promise.all([api("v1/usage"), api("v1/uploads")]);  // the first page: newest 50
      replace(usage, ...usageCard(u));
      replace(listBody, uploadsTable(items, remove),
              total > items.length ? h("p", {class: "muted", id: "uploads-more"},
                                       `The newest ${items.length} of ${total} uploads.`) : null);
    } catch (err) {
      replace(usage, h("p", {class: "error-box"}, err.message));
    }
  }

  async function remove(upload) {
    if (!window.confirm(`Delete upload ${upload.name} (${upload.ref})? Jobs can no longer name it.`)) return;
    try {
      await api(`v1/uploads/${upload.id}`, {method: "DELETE"});
    } catch (err) {
      window.alert(err.message);
    }
    load();
  }

  form.append(uploadForm(load));
  load();
}
