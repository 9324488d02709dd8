// A job's metric series: first thinned by the server (min/max buckets keep spikes), then appended live
// from the job's event stream (a metric or eval event's points share its seq: worker/ingest.py).
import { jobEnded, request } from "./api.js";
import { followEvents } from "./sse.js";

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

/** Follow the job's metric and eval events after `state.after`, adding their points to `state` and
 * calling `onChange()` after each; resumed with Last-Event-ID after a drop (sse.js). Ends with the job.
 * The same stream brings `checkpoint` events (one stream fewer against the owner's limit), each passed
 * to `onCheckpoint({step, epoch, loss})`. */
export function followPoints(jobId, state, signal, onChange, onCheckpoint = () => {}) {
  return followEvents(`/v1/jobs/${jobId}/events?kind=metric&kind=eval&kind=checkpoint&after=${state.after}`, {
    signal,
    onEvent: (event) => {
      const data = JSON.parse(event.data);
      if (event.event === "checkpoint") {
        state.after = data.seq;
        onCheckpoint(data);
        return;
      }
      // As the worker stores them: numbers (null for NaN), at step 0 when the event has none.
      const points = Object.entries(data.values || {}).filter(([, v]) => v === null || typeof v === "number")
        .map(([name, value]) => ({ name, value, step: data.step ?? 0 }));
      addPoints(state.series, points);
      state.after = data.seq;
      onChange();
    },
    ended: () => jobEnded(jobId, signal),
  });
}

/** Append the points stored since `state.after` (when the stream is refused); true when there were any. */
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
