// The one place that talks to the server: the key, authenticated fetches, problem+json errors and the
// vocabulary (statuses) read from /openapi.json, so the page keeps no copy of the server's enums.

const KEY_NAME = "trainjobs.key";

/** The key for this tab: sessionStorage first, then a remembered one from localStorage. */
export function currentKey() {
  return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || "";
}

export function storeKey(key, remember) {
  sessionStorage.setItem(KEY_NAME, key);
  if (remember) localStorage.setItem(KEY_NAME, key);
  else localStorage.removeItem(KEY_NAME);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
}

/** A failed call: `status`, the problem's `detail` and its per-field `errors` ({field, message}). */
export class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
    this.errors = Array.isArray(problem.errors) ? problem.errors : [];
  }
}

const listeners = new Set();
/** Called with no arguments when the server rejects the key (401): the page shows the login box. */
export function onUnauthorized(fn) { listeners.add(fn); }

/** fetch with the Bearer header; the key travels in the header only, never in a URL. */
export async function request(path, { method = "GET", json, body, signal, raw = false, headers: extra = {} } = {}) {
  const headers = { ...extra, Authorization: "Bearer " + currentKey() };
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal });
  if (!response.ok) {
    let problem = {};
    try { problem = await response.json(); } catch { /* not JSON: keep the status alone */ }
    if (response.status === 401) listeners.forEach((fn) => fn());
    throw new ApiError(response.status, problem);
  }
  if (raw) return response;
  return response.status === 204 ? null : response.json();
}

let openapi = null;
/** The OpenAPI document (cached): statuses, the worked examples. */
export async function schema() {
  if (!openapi) openapi = await (await fetch("/openapi.json")).json();
  return openapi;
}

/** Job statuses in the server's order, from the OpenAPI enum. */
export async function jobStatuses() {
  return (await schema()).components.schemas.JobStatus.enum;
}

// The order people read a spec in (the OpenAPI document sorts keys alphabetically).
const SPEC_ORDER = ["name", "task", "model", "dataset", "preprocessing", "training", "optimizer", "efficiency",
  "resources", "metrics", "priority", "queue"];

/** `spec` with its top-level fields in reading order (unknown ones last, as they were). */
export function readingOrder(spec) {
  const keys = Object.keys(spec).sort((a, b) => (SPEC_ORDER.indexOf(a) + 1 || 99) - (SPEC_ORDER.indexOf(b) + 1 || 99));
  return Object.fromEntries(keys.map((k) => [k, spec[k]]));
}

/** The first worked example of a job submission, as the docs show it. */
export async function exampleJob() {
  const create = (await schema()).components.schemas.JobCreate;
  return readingOrder(structuredClone((create.examples || [])[0] || {}));
}

/** A job has ended once it has a finish time (the server sets it on every terminal status). */
export function isFinished(job) { return job.finished_at != null; }

/** Whether job `id` has ended, asked of the server: an event stream also ends when an API restarts. */
export async function jobEnded(id, signal) { return isFinished(await request(`/v1/jobs/${id}`, { signal })); }
