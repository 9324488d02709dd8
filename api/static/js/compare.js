// Compare 2-5 jobs: their loss and eval curves overlaid, and the spec fields that differ.
import { request } from "./api.js";
import { alignSeries, createChart, isFraction, PALETTE } from "./charts.js";
import { chartOrder, loadSeries } from "./metrics.js";
import { el, flatten, statusBadge } from "./util.js";

export const MAX_COMPARE = 5;

function differingFields(jobs) {
  const flat = jobs.map((job) => flatten(job.spec));
  const keys = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort();
  return keys.filter((key) => new Set(flat.map((f) => JSON.stringify(f[key] ?? null))).size > 1)
    .map((key) => [key, flat.map((f) => f[key])]);
}

function picker(ids, signal) {
  const select = el("select", { name: "add" }, el("option", { value: "" }, "add a job…"));
  request("/v1/jobs?limit=100", { signal }).then((page) => {
    for (const job of page.items) if (!ids.includes(job.id)) select.append(el("option", { value: job.id }, `${job.name} (${job.status})`));
  }).catch(() => {});
  select.onchange = () => { if (select.value) location.hash = `#/compare/${[...ids, select.value].join(",")}`; };
  select.disabled = ids.length >= MAX_COMPARE;
  return select;
}

export async function mountCompare(root, ids, signal) {
  ids = [...new Set(ids)].slice(0, MAX_COMPARE);
  const jobs = await Promise.all(ids.map((id) => request(`/v1/jobs/${id}`, { signal })));
  const states = await Promise.all(ids.map((id) => loadSeries(id, signal)));
  const legend = el("ul.compare-legend", {}, jobs.map((job, i) => el("li", {},
    el("i", { style: `background:${PALETTE[i % PALETTE.length]}` }), el("a", { href: `#/jobs/${job.id}` }, job.name), " ",
    statusBadge(job), " ",
    el("a.small", { href: `#/compare/${ids.filter((x) => x !== job.id).join(",")}`, title: "remove" }, "✕"))));
  const charts = el("div.charts");
  root.replaceChildren(el("h2", {}, "Compare"), el("div.toolbar", {}, picker(ids, signal)), legend, charts);
  if (jobs.length < 2) {
    charts.append(el("p.muted", {}, "Pick at least one more job to compare."));
  }
  const names = chartOrder([...new Set(states.flatMap((s) => [...s.series.keys()]))])
    .filter((n) => n === "loss" || n.startsWith("eval_"));
  const made = [];
  for (const name of names) {
    const present = states.map((s) => s.series.get(name) || { steps: [], values: [] });
    const { steps, columns } = alignSeries(present);
    const chart = createChart(charts, { title: name.replaceAll("_", " "), name, labels: jobs.map((j) => j.name),
      fraction: isFraction(name, jobs) });
    chart.set(steps, columns);
    made.push(chart);
  }
  signal.addEventListener("abort", () => made.forEach((c) => c.destroy()));
  const diffs = differingFields(jobs);
  const table = el("table.diff", { dataset: { diff: "" } },
    el("thead", {}, el("tr", {}, el("th", {}, "spec field"), jobs.map((j) => el("th", {}, j.name)))),
    el("tbody", {}, diffs.map(([key, values]) => el("tr", {}, el("td", {}, el("code", {}, key)),
      values.map((v) => el("td", {}, v === undefined ? "–" : JSON.stringify(v)))))));
  root.append(el("h3", {}, "Spec fields that differ"), diffs.length ? table : el("p.muted", {}, "The specs are the same."));
}
