// A job's metric series: first thinned by the server (min/max buckets keep spikes), then appended live.
import { request } from "./api.js";

export const MAX_POINTS = 2000;

function addPoints(series, items) {
  for (const point of items) {
    if (!series.has(point.name)) series.set(point.name, { steps: [], values: [] });
    const s = series.get(point.name);
    s.steps.push(point.step);
    s.values.push(point.value);
  }
}

/** {series: Map(name -> {steps, values}), after}: every series of the job, at most MAX_POINTS each. */
export async function loadSeries(jobId, signal) {
  const page = await request(`/v1/jobs/${jobId}/metrics?max_points=${MAX_POINTS}`, { signal });
  const series = new Map();
  addPoints(series, page.items);
  return { series, after: page.next_after };
}

/** Append the points stored since `state.after`; true when there were any. */
export async function appendNew(jobId, state, signal) {
  let changed = false;
  for (;;) {
    const page = await request(`/v1/jobs/${jobId}/metrics?after=${state.after}&limit=5000`, { signal });
    addPoints(state.series, page.items);
    changed ||= page.items.length > 0;
    state.after = page.next_after;
    if (!page.has_more) return changed;
  }
}

/** Train-time charts first (loss, learning rate, grad norm), then every eval metric, then the rest. */
export function chartOrder(names) {
  const first = ["loss", "learning_rate", "grad_norm"].filter((n) => names.includes(n));
  const evals = names.filter((n) => n.startsWith("eval_") && !first.includes(n)).sort();
  const rest = names.filter((n) => !first.includes(n) && !evals.includes(n)).sort();
  return [...first, ...evals, ...rest];
}
