// The dashboard shell: navigation, client-side routes under /ui/, and the API-key prompt.

import {api, forgetKey, getKey, setKey, UI} from "./api.js";
import {h, replace} from "./dom.js";
import {renderJob} from "./pages/job.js";
import {renderJobs} from "./pages/jobs.js";
import {renderScores} from "./pages/scores.js";
import {renderStorage} from "./pages/storage.js";
import {renderSubmit} from "./pages/submit.js";

const ROUTES = [
  [/^(?:jobs)?$/, "jobs", renderJobs],
  [/^submit$/, "submit", renderSubmit],
  [/^jobs\/([0-9a-zA-Z_-]{1,64})$/, "jobs", renderJob],
  [/^scores$/, "scores", renderScores],
  [/^storage$/, "storage", renderStorage],
];

const main = document.getElementById("main");
let dispose = null;

/** The route of a location under /ui/: "", "submit", "jobs/ID", "scores", "storage". */
function routeOf(location) {
  const path = location.pathname;
  return path.startsWith(UI.pathname) ? path.slice(UI.pathname.length).replace(/\/+$/, "") : path.replace(/^\/+/, "");
}

export function navigate(to, {replace: replaceState = false} = {}) {
  const url = new URL(to, UI);
  if (replaceState) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  render();
}

function render() {
  if (dispose) { dispose(); dispose = null; }
  const route = routeOf(window.location);
  const params = new URLSearchParams(window.location.search);
  for (const a of document.querySelectorAll("nav a[data-nav]")) {
    const match = ROUTES.find(([re]) => re.test(route));
    a.classList.toggle("active", Boolean(match) && a.dataset.nav === match[1]);
  }
  const container = replace(main, "");
  for (const [re, , page] of ROUTES) {
    const m = re.exec(route);
    if (m) {
      dispose = page(container, {id: m[1], params, navigate}) || null;
      return;
    }
  }
  document.title = "Not found · dtp-layout";
  container.append(h("section", {class: "card"}, h("h1", {}, "Not found"),
    h("p", {}, "No page at this address. ", h("a", {href: "./", "data-link": ""}, "Back to the jobs"))));
}

// In-app links: <a data-link href="…"> (relative to /ui/) change the route without a reload.
document.addEventListener("click", (ev) => {
  const a = ev.target.closest && ev.target.closest("a[data-link]");
  if (!a || ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey || ev.altKey) return;
  ev.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", render);

// ---- the API key ---------------------------------------------------------------------------------

const keyStatus = document.getElementById("key-status");
const dialog = document.getElementById("key-dialog");
const keyForm = document.getElementById("key-form");
const keyInput = document.getElementById("key-input");
const keyError = document.getElementById("key-error");

function showKeyStatus() {
  if (getKey()) {
    replace(keyStatus, h("span", {class: "key-on", title: "sent as the X-API-Key header"}, "API key set"), " ",
      h("button", {type: "button", class: "small ghost", id: "forget-key", onclick: () => { forgetKey(); render(); }}, "forget"));
  } else {
    replace(keyStatus, h("button", {type: "button", class: "small ghost", id: "enter-key",
                                    onclick: () => askKey("")}, "API key…"));
  }
}

function askKey(message) {
  // A 401 while the dialog is up (the page sends several requests at once) keeps what is typed and what the
  // dialog already says: "refused this key" from the user's own try outranks a page request's "needs a key".
  if (!dialog.open) {
    keyError.textContent = message || "";
    keyInput.value = "";
    dialog.showModal();
  } else if (!keyError.textContent) {
    keyError.textContent = message || "";
  }
  keyInput.focus();
}

keyForm.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  if (ev.submitter && ev.submitter.value === "cancel") { dialog.close(); return; }
  const key = keyInput.value.trim();
  if (!key) { keyError.textContent = "Enter the key your administrator gave you."; return; }
  setKey(key, document.getElementById("key-remember").checked);
  try {
    await api("v1/jobs", {params: {limit: 1}});
    dialog.close();
    render();
  } catch (err) {
    if (err.status === 401) { forgetKey(); keyError.textContent = `The service refused this key: ${err.message}`; }
    else { dialog.close(); render(); }
  }
});

window.addEventListener("dtp-need-key", (ev) => {
  const hadKey = Boolean(getKey());
  askKey(hadKey ? `The service refused the key (${ev.detail}).` : "This service needs an API key.");
});
window.addEventListener("dtp-key-changed", showKeyStatus);

showKeyStatus();
render();
