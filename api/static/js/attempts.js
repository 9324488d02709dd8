// The job's attempts and retries with their reasons. An attempt runs from a claim (a `running` status
// event) to what ended it: a move back to `queued` (its reason says why: `worker_lost` when the slot, host
// or run process was lost, `out_of_memory` for a retry) or the final status. The status events come from
// the public event stream filtered to `kind=status` (sse.js, resumed after a drop), so a live job's
// list grows; the changes an out-of-memory retry applied come from the job detail's `retries`.
import { jobEnded } from "./api.js";
import { followEvents } from "./sse.js";
import { el } from "./util.js";

/** Attempts from status events in order: {n, started, ended, outcome, reason, message}. */
export function attemptsFrom(events) {
  const attempts = [];
  let current = null;
  for (const e of events) {
    if (e.status === "running") {
      current = { n: attempts.length + 1, started: e.time, outcome: "running" };
      attempts.push(current);
    } else if (current) {  // a move before any claim (cancelled while queued) ended no attempt
      Object.assign(current, { ended: e.time, outcome: e.status, reason: e.reason, message: e.message });
      current = null;
    }
  }
  return attempts;
}

/** Call `onEvent(data)` for each status event of job `id`, until the job ends or `signal` aborts. */
export function followStatusEvents(id, signal, onEvent) {
  return followEvents(`/v1/jobs/${id}/events?kind=status`, {
    signal,
    onEvent: (event) => onEvent(JSON.parse(event.data)),
    ended: () => jobEnded(id, signal),
  });
}

function changesText(retry) {
  if (!retry || !retry.changes) return "";
  return Object.entries(retry.changes).map(([field, value]) => `${field} → ${value}`).join(", ");
}

function clock(iso) { return iso ? new Date(iso).toLocaleTimeString() : "–"; }

/** The attempts card: one row per attempt, the out-of-memory retries' changes beside theirs. */
export function attemptsPanel(events, retries) {
  const attempts = attemptsFrom(events);
  let oom = 0;
  const rows = attempts.map((a) => {
    const retry = a.outcome === "queued" && a.reason === "out_of_memory" ? (retries || [])[oom++] : null;
    const changes = changesText(retry);
    return el("tr", { dataset: { attempt: String(a.n), outcome: a.outcome, reason: a.reason || "" } },
      el("td", {}, String(a.n)), el("td", {}, clock(a.started)), el("td", {}, clock(a.ended)),
      el("td", {}, el(`span.badge.status-${a.outcome}`, {}, a.outcome === "queued" ? "requeued" : a.outcome)),
      el("td", {}, a.reason ? el("code", {}, a.reason) : ""),
      el("td", {}, a.message ? el("pre.message", {}, a.message) : "",
        changes ? el("div.changes", {}, "retried with ", changes) : null));
  });
  return el("div.card.attempts", { dataset: { attempts: String(attempts.length) } },
    el("h3", {}, `Attempts (${attempts.length})`),
    attempts.length
      ? el("table", {}, el("tr", {}, ["#", "started", "ended", "outcome", "reason", "message"].map((h) => el("th", {}, h))), rows)
      : el("p.muted", {}, "Not started yet."));
}
