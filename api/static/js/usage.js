// The usage page (#/usage): device-hours and cost of the jobs that finished in a period (GET /v1/usage),
// a bar chart per UTC day and a table by owner, queue or day. A key sees its owner's usage; an admin
// every owner's. The charging rule is the server's (service_core/usage.py): nothing is summed here.
import { request } from "./api.js";
import { money } from "./panels.js";
import { el, num } from "./util.js";

const DAY_MS = 86400000;

function isoDay(date) { return date.toISOString().slice(0, 10); }

function jobsText(jobs) {
  return Object.entries(jobs).sort().map(([status, n]) => `${n} ${status}`).join(", ") || "–";
}

function table(report) {
  const rows = [...report.groups, report.total].map((g) => el("tr", { dataset: { group: g.key } },
    el("td", {}, g.key), el("td.num", {}, num(g.device_hours, 4)), el("td.num", {}, money(g.cost)),
    el("td", {}, jobsText(g.jobs))));
  return el("table.usage", {}, el("thead", {}, el("tr", {}, [report.group_by, "device-hours", "cost", "jobs"]
    .map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

/** Device-hours per day as bars, every day of the period present (a day without jobs is 0). */
function dayChart(host, report, start, end) {
  const byDay = new Map(report.groups.map((g) => [g.key, g.device_hours]));
  const xs = [], ys = [];
  for (let t = Date.parse(isoDay(start)); t < end.getTime(); t += DAY_MS) {
    xs.push(t / 1000);
    ys.push(byDay.get(isoDay(new Date(t))) || 0);
  }
  const options = {
    width: Math.min(900, host.clientWidth || 900), height: 220, title: "device-hours per day (UTC)",
    scales: { x: { time: true, range: () => [xs[0] - DAY_MS / 2000, xs[xs.length - 1] + DAY_MS / 2000] },
      y: { range: (u, min, max) => [0, Math.max(max, 1e-6) * 1.1] } },
    series: [{ value: (u, t) => (t == null ? "–" : isoDay(new Date(t * 1000))) },
      { label: "device-hours", stroke: "#2563eb", fill: "rgba(37,99,235,.35)", value: (u, v) => num(v, 4),
        paths: uPlot.paths.bars({ size: [0.8, 40] }), points: { show: false } }],
    // Whole days on x (MM-DD), the same number format as the table on y.
    axes: [{ incrs: [86400, 2 * 86400, 7 * 86400, 30 * 86400], values: (u, ticks) => ticks.map((t) => isoDay(new Date(t * 1000)).slice(5)) },
      { size: 70, values: (u, ticks) => ticks.map((v) => num(v, 3)) }],
  };
  host.replaceChildren();
  return new uPlot(options, [xs, ys], host);
}

export async function mountUsage(root, signal) {
  const now = new Date();
  const monthStart = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1));
  const from = el("input", { type: "date", name: "from", value: isoDay(monthStart) });
  const to = el("input", { type: "date", name: "to", value: isoDay(new Date(now.getTime() + DAY_MS)) });
  const groupBy = el("select", { name: "group_by" }, ["owner", "queue", "day"].map((g) => el("option", { value: g }, g)));
  const owner = el("input", { type: "text", name: "owner", placeholder: "owner (admins)", size: 14 });
  const chartHost = el("div.usage-chart");
  const summary = el("p.muted");
  const tableHost = el("div");
  const note = el("p.error");
  let chart = null;
  signal.addEventListener("abort", () => chart?.destroy());

  async function load() {
    note.textContent = "";
    const start = new Date(`${from.value}T00:00:00Z`), end = new Date(`${to.value}T00:00:00Z`);
    const params = (group) => {
      const p = new URLSearchParams({ from: start.toISOString(), to: end.toISOString(), group_by: group });
      if (owner.value.trim()) p.set("owner", owner.value.trim());
      return p;
    };
    try {
      const [grouped, daily] = await Promise.all([request(`/v1/usage?${params(groupBy.value)}`, { signal }),
        request(`/v1/usage?${params("day")}`, { signal })]);
      const total = grouped.total;
      summary.replaceChildren(el("b", { dataset: { totalHours: "" } }, num(total.device_hours, 4)), " device-hours",
        total.cost == null ? "" : ` · cost ${money(total.cost)}`, ` · ${jobsText(total.jobs)}`,
        grouped.owner ? ` · owner ${grouped.owner}` : " · every owner");
      tableHost.replaceChildren(table(grouped));
      chart?.destroy();
      chart = dayChart(chartHost, daily, start, end);
    } catch (error) {
      if (!signal.aborted) note.replaceChildren(error.message, ...error.errors.map((e) => el("div", {}, `${e.field}: ${e.message}`)));
    }
  }
  for (const input of [from, to, groupBy, owner]) input.onchange = load;
  root.replaceChildren(el("h2", {}, "Usage"),
    el("p.muted", {}, "Jobs that finished in the period: every attempt's running time × its devices, at the queue's price when submitted."),
    el("div.toolbar", {}, el("label", {}, "From ", from), el("label", {}, "to ", to), el("label", {}, "by ", groupBy), owner),
    note, summary, chartHost, tableHost);
  await load();
}
