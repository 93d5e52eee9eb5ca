// The /v1 API as the dashboard uses it. With API keys on, the key is sent as the X-API-Key header,
// never in a URL; it is kept for the tab (sessionStorage) or, when asked, for the browser (localStorage).

const KEY_NAME = "dtp-layout-api-key";

// index.html sets <base href="ROOT/ui/">; the API lives at ROOT/v1.
export const ROOT = new URL("../", document.baseURI);
export const UI = new URL("./", document.baseURI);

export function apiUrl(path, params) {
  const url = new URL(path.replace(/^\//, ""), ROOT);
  for (const [k, v] of Object.entries(params || {})) {
    if (v !== null && v !== undefined && v !== "") url.searchParams.set(k, String(v));
  }
  return url;
}

/** The path of an artifact, each part of its name escaped (the name keeps its slashes). */
export function artifactPath(jobId, name) {
  return `v1/jobs/${encodeURIComponent(jobId)}/artifacts/${name.split("/").map(encodeURIComponent).join("/")}`;
}

export function getKey() {
  return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || "";
}

export function setKey(key, remember) {
  sessionStorage.setItem(KEY_NAME, key);
  if (remember) localStorage.setItem(KEY_NAME, key);
  else localStorage.removeItem(KEY_NAME);
  window.dispatchEvent(new CustomEvent("dtp-key-changed"));
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  window.dispatchEvent(new CustomEvent("dtp-key-changed"));
}

export class ApiError extends Error {
  constructor(status, body, url) {
    const detail = body && body.detail;
    const text = (body && body.message) || (typeof detail === "string" ? detail : null) || `HTTP ${status}`;
    super(text);
    this.status = status;
    this.body = body;
    this.url = url;
    // 422: field → messages, as the API names them ("calibration.sequences", "distill.layouts.0", …)
    this.fields = {};
    if (Array.isArray(detail)) {
      for (const item of detail) {
        const field = item.field || "body";
        (this.fields[field] = this.fields[field] || []).push(item.msg || String(item));
      }
    }
  }
}

/** A request's headers, with `key` ("" for none) as X-API-Key; the caller keeps `key` for errorFrom. */
function headers(key, extra) {
  const out = {Accept: "application/json", ...(extra || {})};
  if (key) out["X-API-Key"] = key;
  return out;
}

/** The ApiError of a non-2xx answer to a request sent with `sentKey`. A 401 asks for the key only when
 *  that request carried the key in use now: one sent before the user entered a new key (with none, or an
 *  older one) can be refused after the dialog has closed, and must not open it again. Its caller still
 *  gets the error; the next request reads the new key. */
async function errorFrom(response, url, sentKey) {
  let body = null;
  try { body = await response.json(); } catch { body = {detail: response.statusText}; }
  const err = new ApiError(response.status, body, url);
  if (response.status === 401 && sentKey === getKey()) {
    window.dispatchEvent(new CustomEvent("dtp-need-key", {detail: err.message}));
  }
  return err;
}

/** GET/POST a JSON endpoint; throws ApiError for a non-2xx answer (a 401 for the current key also asks
 *  for the key). */
export async function api(path, {method = "GET", params, body, signal} = {}) {
  const url = apiUrl(path, params);
  const key = getKey();
  const init = {method, headers: headers(key, body !== undefined ? {"Content-Type": "application/json"} : {}), signal,
                cache: "no-store"};
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, {detail: `the service at ${ROOT.origin} is unreachable (${err.message})`}, url);
  }
  if (!response.ok) throw await errorFrom(response, url, key);
  return response.status === 204 ? null : response.json();
}

let specRequest = null;

/** GET /v1/spec, asked once per page load (again after a failure): the names the dashboard shows but
 *  never restates — the job statuses, the stages in their order, the spec's fields and defaults. */
export function specInfo() {
  specRequest ??= api("v1/spec").catch((err) => { specRequest = null; throw err; });
  return specRequest;
}

/** PUT raw bytes (an upload's part); throws ApiError for a non-2xx answer. */
export async function apiPut(path, blob) {
  const url = apiUrl(path);
  const key = getKey();
  let response;
  try {
    response = await fetch(url, {method: "PUT", body: blob, cache: "no-store",
                                 headers: headers(key, {"Content-Type": "application/octet-stream"})});
  } catch (err) {
    throw new ApiError(0, {detail: `the service at ${ROOT.origin} is unreachable (${err.message})`}, url);
  }
  if (!response.ok) throw await errorFrom(response, url, key);
}

export async function sha256Hex(blob) {
  if (!(window.crypto && crypto.subtle)) return null; // only in secure contexts (https, localhost)
  const digest = await crypto.subtle.digest("SHA-256", await blob.arrayBuffer());
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

/** Download through fetch (so the key goes in a header), check the sha256 when the browser can,
 *  then hand the file to the browser. Returns {verified: true | false | null}. */
export async function downloadWithKey(path, filename, expectedSha256) {
  const url = apiUrl(path);
  // X-Store-Redirect: a service that redirects downloads to its object store (DTP_LAYOUT_STORAGE_REDIRECT)
  // answers with the presigned URL as JSON instead: a fetch would carry the key to the store, and the
  // page's CSP keeps fetch on this origin. The browser then opens the URL itself (verified by the service).
  const key = getKey();
  const response = await fetch(url, {headers: headers(key, {Accept: "*/*", "X-Store-Redirect": "json"}),
                                     cache: "no-store"});
  if (!response.ok) throw await errorFrom(response, url, key);
  if (response.headers.get("x-store-redirect") === "json") {
    const {location} = await response.json();
    openLink(location, filename);
    return {verified: null, redirected: true};
  }
  const blob = await response.blob();
  const actual = expectedSha256 ? await sha256Hex(blob) : null;
  if (actual !== null && actual !== expectedSha256) {
    throw new ApiError(0, {detail: `sha256 mismatch for ${filename}: expected ${expectedSha256}, got ${actual}`}, url);
  }
  const href = URL.createObjectURL(blob);
  openLink(href, filename);
  setTimeout(() => URL.revokeObjectURL(href), 60_000);
  return {verified: actual === null ? null : true};
}

function openLink(href, filename) {
  const a = document.createElement("a");
  a.href = href;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
}

/** The equivalent curl of a GET (the key as a header placeholder, never the key itself). */
export function curlFor(path, {output} = {}) {
  const key = getKey() ? " -H \"X-API-Key: $DTP_LAYOUT_API_KEY\"" : "";
  const out = output ? ` -o '${output.replace(/'/g, "'\\''")}'` : "";
  return `curl -sfL${key}${out} '${apiUrl(path).href}'`;
}
