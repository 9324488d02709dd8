// Job page panels that do not chart: memory (estimate vs measured), time and cost, spec, artifacts, logs,
// trackers, and the values `auto` chose.
import { isFinished, readingOrder, request } from "./api.js";
import { bytes, duration, el, num, toYaml } from "./util.js";

const PART_COLORS = ["#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#64748b", "#ec4899"];
// Measured values the run reports, next to the estimate's figure for the same quantity.
const MEASURED = [
  ["parameters", "parameter_bytes", "parameter_bytes"],
  ["gradients", "gradient_bytes", "gradient_bytes"],
  ["optimizer state", "optimizer_state_bytes", "optimizer_state_bytes"],
  ["peak (GPU)", "peak_allocated_bytes", "total_bytes"],
];

/** The estimate's parts as one stacked bar (against the GPU budget when known) and a legend. */
export function stackedBar(estimate) {
  const parts = (estimate.parts || []).filter((p) => p.bytes > 0);
  const total = estimate.total_bytes || parts.reduce((n, p) => n + p.bytes, 0);
  const scale = Math.max(total, estimate.gpu_memory_bytes || 0) || 1;
  const bar = el("div.stack", { dataset: { total: String(total) }, title: `estimate: ${bytes(total)}` });
  const legend = el("ul.legend");
  parts.forEach((part, i) => {
    const color = PART_COLORS[i % PART_COLORS.length];
    bar.append(el("div.part", {
      style: `width:${(100 * part.bytes) / scale}%;background:${color}`,
      title: `${part.name}: ${bytes(part.bytes)} (${part.formula || ""})`,
      dataset: { part: part.name },
    }));
    legend.append(el("li", {}, el("i", { style: `background:${color}` }), `${part.name.replaceAll("_", " ")} `,
      el("b", {}, bytes(part.bytes))));
  });
  if (estimate.gpu_memory_bytes) {
    bar.append(el("div.budget", { style: `left:${(100 * estimate.gpu_memory_bytes) / scale}%`,
      title: `GPU budget ${bytes(estimate.gpu_memory_bytes)}` }));
  }
  if (estimate.gpu_memory_bytes) {
    legend.append(el("li", {}, el("i", { style: "background:#111827;width:2px" }), `budget ${bytes(estimate.gpu_memory_bytes)}`));
  }
  return el("div.memory-bar", {}, bar, legend);
}

export function memoryPanel(job) {
  const estimate = job.estimate;
  if (!estimate) return el("p.muted", {}, "No estimate stored for this job.");
  const measured = job.memory?.measured || {};
  const rows = MEASURED.map(([label, key, estKey]) => {
    const m = measured[key], e = estimate[estKey];
    const ratio = m != null && e ? m / e : null;
    return el("tr", {}, el("td", {}, label), el("td", {}, bytes(e)), el("td", {}, m == null ? "not measured" : bytes(m)),
      el("td", { className: ratio == null ? "" : Math.abs(ratio - 1) > 0.25 ? "warn" : "ok" },
        ratio == null ? "–" : `${ratio.toFixed(2)}×`));
  });
  const verdict = estimate.fits == null ? "" : estimate.fits ? "fits" : "does not fit";
  return el("div", {},
    el("p", {}, "Estimated total ", el("b", { dataset: { estimateTotal: "" } }, bytes(estimate.total_bytes)),
      estimate.gpu_memory_bytes ? ` of ${bytes(estimate.gpu_memory_bytes)} per device (${verdict})` : ""),
    stackedBar(estimate),
    el("table.measured", {}, el("thead", {}, el("tr", {}, ...["", "estimated", "measured", "measured / estimated"]
      .map((h) => el("th", {}, h)))), el("tbody", {}, rows)));
}

/** Time and cost: the estimate's training seconds (p10–p90) beside the run's, and the device-hours and
 * cost charged so far beside the predicted (service_core/usage.py); null when there is neither. */
/** An amount of money: cents, whole units from 100, and significant digits below a cent (a short CPU job). */
export function money(value) {
  if (value == null) return "–";
  return value >= 100 ? value.toFixed(0) : value >= 0.01 || value === 0 ? value.toFixed(2) : num(value, 2);
}

export function timeCostPanel(job) {
  const time = job.time, usage = job.usage;
  if (!time && !usage) return null;
  const rows = [];
  if (time) {
    const range = time.p10_s != null ? ` (${duration(time.p10_s)}–${duration(time.p90_s)})` : "";
    rows.push(["train time", time.predicted_s == null ? "not predicted" : `${duration(time.predicted_s)}${range}`,
      time.measured_s == null ? "–" : duration(time.measured_s)]);
  }
  if (usage) {
    rows.push(["device-hours", usage.predicted_device_hours == null ? "–" : num(usage.predicted_device_hours, 3),
      num(usage.device_hours, 3)]);
    if (usage.price_per_device_hour != null) rows.push(["cost", money(usage.predicted_cost), money(usage.cost)]);
  }
  const note = [time && time.calibrated === false ? "uncalibrated estimate" : null,
    usage?.price_per_device_hour != null ? `${usage.price_per_device_hour} per device-hour × ${usage.devices} device(s)`
      : "no price for this queue"].filter(Boolean).join(" · ");
  return el("div.card", { dataset: { timeCost: "" } }, el("h3", {}, "Time and cost"),
    el("table.measured", {}, el("thead", {}, el("tr", {}, ["", "predicted", job.finished_at ? "actual" : "so far"]
      .map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map(([label, predicted, actual]) => el("tr", { dataset: { row: label } },
      el("td", {}, label), el("td", {}, predicted), el("td", {}, actual))))),
    el("p.muted.small", {}, note));
}

export function specPanel(job) {
  return el("pre.spec", {}, toYaml(readingOrder(job.spec)));
}

/** Save what API `path` answers as file `name`. Fetched with the key in its header (a plain link would
 * send none, and the key never goes in a URL), then handed to the browser from memory. */
export async function downloadAs(path, name) {
  const response = await request(path, { raw: true });
  const url = URL.createObjectURL(await response.blob());
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function artifactPath(jobId, path) {
  return `/v1/jobs/${jobId}/artifacts/${path.split("/").map(encodeURIComponent).join("/")}`;
}

export async function artifactsPanel(jobId, signal) {
  const { items } = await request(`/v1/jobs/${jobId}/artifacts`, { signal });
  if (!items.length) return el("p.muted", {}, "No artifacts yet: they are stored when the run ends.");
  return el("table.artifacts", {}, el("tbody", {}, items.map((item) => el("tr", {},
    el("td", {}, el("a", { href: "#", onclick: (e) => { e.preventDefault(); downloadAs(artifactPath(jobId, item.path),
      item.path.split("/").pop()); } }, item.path)),
    el("td.num", {}, bytes(item.size))))));
}

/** Progress bars redraw a line with "\r": keep what the terminal would show; drop colour codes. */
export function terminalText(text) {
  return text.replace(/\x1b\[[0-9;]*[A-Za-z]/g, "").split("\n")
    .map((line) => line.replace(/\r+$/, "").split("\r").pop()).join("\n");
}

/** The run's output, polled from GET /logs?offset= and appended while the job runs. */
export function logsPanel(jobId, getJob, signal) {
  const pre = el("pre.logs", { dataset: { logs: "" } }, "");
  const node = el("div", {}, pre);
  let offset = 0, timer = null;
  async function poll() {
    try {
      for (;;) {
        const chunk = await request(`/v1/jobs/${jobId}/logs?offset=${offset}&limit=262144`, { signal });
        const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 40;
        if (chunk.text) pre.append(terminalText(chunk.text));
        offset = chunk.next_offset;
        if (atBottom) pre.scrollTop = pre.scrollHeight;
        if (chunk.complete) {
          if (!offset) pre.textContent = "(this run wrote no output)";
          return;
        }
        if (!chunk.text) break;
      }
    } catch (error) {
      if (signal.aborted) return;
      pre.append(`\n[could not read the log: ${error.message}]\n`);
    }
    if (!signal.aborted) timer = setTimeout(poll, isFinished(getJob()) ? 3000 : 1500);
  }
  poll();
  signal.addEventListener("abort", () => clearTimeout(timer));
  return node;
}

const TRACKER_NAMES = { wandb: "Weights & Biases", mlflow: "MLflow" };

/** The job's W&B / MLflow runs (`tracker_links`): a link to each run's page, else its id. */
export function trackersPanel(job) {
  const links = Object.entries(job.tracker_links || {});
  if (!links.length) return null;
  const rows = links.map(([name, link]) => {
    // Only http(s) pages become links (the API keeps no other); an offline W&B run has none.
    const page = /^https?:\/\//.test(link.url || "")
      ? el("a", { href: link.url, target: "_blank", rel: "noopener noreferrer" }, link.run_id)
      : el("code", { title: link.dir || "" }, link.run_id);
    return [el("dt", {}, TRACKER_NAMES[name] || name), el("dd", { dataset: { tracker: name } }, page)];
  });
  return el("div.card", {}, el("h3", {}, "Trackers"), el("dl.facts", {}, rows));
}

/** The values the service chose for fields the spec wrote as `auto` (trainer_core/auto.py), each with why. */
export function autoPanel(job) {
  if (!job.auto?.length) return null;
  return el("div.card", { dataset: { auto: "" } }, el("h3", {}, "Chosen for auto"),
    el("dl.facts", {}, job.auto.map((choice) => [el("dt", {}, el("code", {}, choice.field)),
      el("dd", { dataset: { field: choice.field } }, el("strong", {}, String(choice.value)), " ",
        el("span.muted.small", {}, choice.why))])));
}

/** Where the job started (`init_from`: another job's checkpoint) and the jobs started from its own. */
export function lineagePanel(job) {
  const rows = [];
  const source = job.started_from;
  if (source) {
    rows.push(el("dt", {}, "Started from"), el("dd", { dataset: { startedFrom: source.job } },
      el("a", { href: `#/jobs/${source.job}` }, el("code", {}, source.job)), ` at checkpoint ${source.checkpoint}`));
  }
  if (job.continued_by?.length) {
    rows.push(el("dt", {}, "Continued by"), el("dd", { dataset: { continuedBy: "" } },
      job.continued_by.flatMap((id, i) => [i ? ", " : "", el("a", { href: `#/jobs/${id}` }, el("code", {}, id))])));
  }
  return rows.length ? el("div.card", { dataset: { lineage: "" } }, el("h3", {}, "Lineage"), el("dl.facts", {}, rows)) : null;
}

/** A multi-node job's gang (worker/gang.py): each node's rank, host and worker, running or forming. */
export function nodesPanel(job) {
  if (!job.nodes?.length) return null;
  const rows = job.nodes.flatMap((node) => [
    el("dt", {}, node.node === null ? "joined" : `node ${node.node}`),
    el("dd", { dataset: { node: node.node ?? "" } }, el("code", {}, node.host), " ",
      el("span.muted.small", {}, `${node.worker}, reached at ${node.address}`))]);
  return el("div.card", { dataset: { nodes: "" } }, el("h3", {}, "Nodes"), el("dl.facts", {}, rows));
}
