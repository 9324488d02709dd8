// The job list: status filter, name search, owner (admins), live refresh, keyset "load more",
// and picking 2-5 jobs to compare.
import { isFinished, jobStatuses, request } from "./api.js";
import { duration, el, num, pace, replaceIfChanged, runSeconds, statusBadge, when } from "./util.js";

const PAGE = 50;
const POLL_MS = 3000;
const SPARK_POINTS = 60;
const SPARK_REFRESH_MS = 15000;  // a running job's sparkline: at most this often (each one reads its loss series)

/** A tiny SVG line of `values` (null gaps skipped). */
function sparkline(values) {
  const ys = values.filter((v) => v != null && isFinite(v));
  if (ys.length < 2) return el("span.muted", {}, "–");
  const lo = Math.min(...ys), hi = Math.max(...ys), w = 90, h = 22;
  const points = ys.map((v, i) => `${((i / (ys.length - 1)) * w).toFixed(1)},${(h - 2 - ((v - lo) / (hi - lo || 1)) * (h - 4)).toFixed(1)}`);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("class", "spark");
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.join(" "));
  svg.append(line);
  return svg;
}

/** Loss sparklines by job id, fetched once for a finished job and now and then for a running one. */
function sparklines(signal, redraw) {
  const cache = new Map();
  return (job) => {
    const entry = cache.get(job.id);
    const due = !entry || (!entry.final && Date.now() - entry.at > SPARK_REFRESH_MS);
    if (due && !(entry && entry.loading)) {
      const next = { ...(entry || { values: [] }), loading: true, at: Date.now() };
      cache.set(job.id, next);
      request(`/v1/jobs/${job.id}/metrics?name=loss&max_points=${SPARK_POINTS}`, { signal }).then((page) => {
        cache.set(job.id, { values: page.items.map((p) => p.value), at: Date.now(), final: isFinished(job), loading: false });
        redraw();
      }).catch(() => { next.loading = false; });
    }
    return sparkline(cache.get(job.id).values);
  };
}

function bestEval(job) {
  const values = { ...(job.latest_metrics || {}), ...(job.final_metrics || {}) };
  const name = ["eval_accuracy", "eval_f1", "eval_loss"].find((n) => typeof values[n] === "number") ||
    Object.keys(values).find((n) => n.startsWith("eval_") && typeof values[n] === "number");
  return name ? `${name.replace("eval_", "")} ${num(values[name], 3)}` : "–";
}

function progressCell(job) {
  const { fraction } = job.progress;
  const { eta } = pace(job);
  const text = fraction == null ? (job.progress.step ? `step ${job.progress.step}` : "–") : `${Math.round(100 * fraction)}%`;
  return el("td", {}, el(`div.progress.small.status-${job.status}`, {},
    el("div.fill", { style: `width:${100 * (fraction ?? 0)}%` })),
    el("span.muted", {}, text, !isFinished(job) && eta != null ? ` · ETA ${duration(eta)}` : ""));
}

function row(job, picked, onPick, spark) {
  const status = el("td", {}, statusBadge(job));
  if (job.error?.reason && job.status !== "succeeded") status.append(el("div.reason-small", {}, job.error.reason));
  const box = el("input", { type: "checkbox", checked: picked.has(job.id), onchange: () => onPick(job.id, box.checked),
    title: "pick for compare" });
  return el("tr", { dataset: { jobId: job.id } }, el("td", {}, box),
    el("td", {}, el("a", { href: `#/jobs/${job.id}` }, job.name), el("div.muted.small", {}, job.owner)),
    status, progressCell(job), el("td", {}, spark(job)), el("td", {}, duration(runSeconds(job))), el("td", {}, bestEval(job)),
    el("td", { title: job.created_at }, when(job.created_at)));
}

export async function mountList(root, signal) {
  const statuses = await jobStatuses();
  const statusSelect = el("select", { name: "status" }, el("option", { value: "" }, "any status"),
    statuses.map((s) => el("option", { value: s }, s)));
  const search = el("input", { type: "search", placeholder: "search by name", name: "search" });
  const owner = el("input", { type: "text", placeholder: "owner (admins)", name: "owner", size: 14 });
  const picked = new Set();
  const compare = el("a.button", { href: "#" }, "Compare selected");
  const tbody = el("tbody");
  const more = el("button", { onclick: () => load(true) }, "Load older jobs");
  const note = el("p.muted");
  root.replaceChildren(
    el("div.toolbar", {}, statusSelect, search, owner, compare, el("a.button.primary", { href: "#/submit" }, "New job")),
    el("table.jobs", {}, el("thead", {}, el("tr", {}, ["", "name", "status", "progress", "loss", "duration", "best eval",
      "created"].map((h) => el("th", {}, h)))), tbody), note, more);

  let jobs = [], cursor = null, timer = null;
  const spark = sparklines(signal, () => render());
  function onPick(id, on) {
    if (on) picked.add(id); else picked.delete(id);
    compare.href = picked.size >= 2 && picked.size <= 5 ? `#/compare/${[...picked].join(",")}` : "#";
    compare.classList.toggle("disabled", !(picked.size >= 2 && picked.size <= 5));
    compare.title = "pick 2 to 5 jobs";
  }
  onPick(null, false);
  function render() {
    const term = search.value.trim().toLowerCase();
    const shown = jobs.filter((j) => !term || j.name.toLowerCase().includes(term));
    replaceIfChanged(tbody, shown.map((j) => row(j, picked, onPick, spark)));  // a running job's row alone
    note.textContent = shown.length ? "" : jobs.length ? "No job matches the search." : "No jobs yet.";
    more.hidden = !cursor;
  }
  async function load(older = false) {
    const params = new URLSearchParams({ limit: String(older ? PAGE : Math.max(PAGE, jobs.length)) });
    if (statusSelect.value) params.set("status", statusSelect.value);
    if (owner.value.trim()) params.set("owner", owner.value.trim());
    if (older && cursor) params.set("cursor", cursor);
    try {
      const page = await request(`/v1/jobs?${params}`, { signal });
      jobs = older ? [...jobs, ...page.items] : page.items;
      cursor = page.next_cursor;
      render();
    } catch (error) {
      if (!signal.aborted) note.textContent = error.message;
    }
  }
  async function tick() {
    await load();
    if (!signal.aborted) timer = setTimeout(tick, POLL_MS);
  }
  statusSelect.onchange = () => { jobs = []; load(); };
  owner.onchange = () => { jobs = []; load(); };
  search.oninput = render;
  signal.addEventListener("abort", () => clearTimeout(timer));
  await tick();
}
