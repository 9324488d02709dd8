// The job page's checkpoints (GET /v1/jobs/{id}/checkpoints): each with the loss and the evaluation at
// or before its step, its size and time, the best by the API's best_metric, whether retention keeps it,
// and a download of it as a zip. The page fetches the list again when the job's stream says one is
// complete (metrics.js follows `checkpoint` events with the metric ones); nothing polls it.
import { bytes, el, num, when } from "./util.js";
import { downloadAs } from "./panels.js";

/** The chart markers for `list`: one per checkpoint step, the best one flagged. */
export function checkpointMarkers(list) {
  return (list?.items || []).map((item) => ({ step: item.step, best: item.is_best }));
}

/** Whether chart `name` marks checkpoints: the training loss and the evaluation metrics. */
export function marksCheckpoints(name) {
  return name === "loss" || name.startsWith("eval_");
}

function evaluationCell(item) {
  const values = Object.entries(item.eval_metrics || {});
  if (item.eval_step == null || !values.length) return el("td.muted", {}, "–");
  return el("td.evaluation", {},
    values.map(([name, value]) => el("span.metric", { dataset: { metric: name } }, `${name.replace(/^eval_/, "")} `,
      el("b", {}, num(value)))),
    item.eval_step === item.step ? null : el("span.muted", {}, ` (step ${item.eval_step})`));
}

function downloadCell(jobId, item) {
  const name = `${jobId}-checkpoint-${item.step}.zip`;
  const note = el("span.error");
  // The link names the zip; a click fetches it with the key in a header, as the artifacts tab does.
  const link = (label, href, title) => el("a.button", { href, title, dataset: { download: "" }, onclick: (e) => {
    e.preventDefault();
    note.textContent = "";
    downloadAs(href, name).catch((error) => { note.textContent = ` ${error.message}`; });
  } }, label);
  return el("td.download", {}, link("Download", item.download_url, "weights, config, tokenizer, scheduler"), " ",
    link("+ optimizer", `${item.download_url}?with_optimizer=true`, "also the optimizer state, to resume training"),
    note);
}

/** The checkpoints of `list` (the API's answer) as a table, oldest first. */
export function checkpointsTable(jobId, list) {
  const items = list?.items || [];
  if (!items.length) {
    return el("p.muted", { dataset: { checkpoints: "0" } }, "No checkpoints yet: the run saves one every training.save_steps steps.");
  }
  const better = list.greater_is_better ? "higher" : "lower";
  const limit = list.save_total_limit;
  const rows = items.map((item) => el("tr", { dataset: { checkpoint: String(item.step), ...(item.is_best ? { best: "" } : {}) } },
    el("td.num", {}, String(item.step), " ", item.is_best ? el("span.badge.best", { title: `best ${list.best_metric}` }, "best") : null),
    el("td.num", {}, item.epoch == null ? "–" : num(item.epoch, 3)),
    el("td.num", {}, num(item.loss)),
    evaluationCell(item),
    el("td.num", { title: `${item.size} bytes` }, bytes(item.size)),
    el("td", { title: item.created_at || "" }, when(item.created_at)),
    el("td", { dataset: { kept: String(item.kept) } }, item.kept ? "kept" : el("span.muted", {}, `beyond save_total_limit ${limit}`)),
    downloadCell(jobId, item)));
  return el("div", {},
    el("p.muted.small", {}, `Best by ${list.best_metric} (${better} is better); `,
      limit == null ? "all kept (no training.save_total_limit)." : `retention keeps the newest ${limit}.`),
    el("table.checkpoints", { dataset: { checkpoints: String(items.length) } },
      el("thead", {}, el("tr", {}, ["step", "epoch", "loss", "evaluation", "size", "taken", "retention", ""]
        .map((h) => el("th", {}, h)))),
      el("tbody", {}, rows)));
}
