// The job page: header with pause/resume and cancel, failure panel, progress, memory, attempts, live charts, logs, spec,
// checkpoints, artifacts.
// Everything it starts (timers, fetches, charts) hangs off one AbortController, so leaving the page
// or switching to another job drops all of the previous job's state.
import { isFinished, request } from "./api.js";
import { attemptsPanel, followStatusEvents } from "./attempts.js";
import { createChart, isFraction } from "./charts.js";
import { checkpointMarkers, checkpointsTable, marksCheckpoints } from "./checkpoints.js";
import { appendNew, chartOrder, followPoints, loadSeries } from "./metrics.js";
import { artifactsPanel, autoPanel, lineagePanel, logsPanel, memoryPanel, nodesPanel, specPanel, timeCostPanel, trackersPanel } from "./panels.js";
import { duration, el, num, pace, replaceIfChanged, runSeconds, samplesPerSecond, statusBadge, when } from "./util.js";

const POLL_MS = 2000;

function progressBlock(job) {
  const { step, total, epoch, fraction } = job.progress;
  const { eta } = pace(job);
  const bar = el(`div.progress.status-${job.status}`, {}, el("div.fill", { style: `width:${100 * (fraction ?? 0)}%` }));
  const facts = [
    ["step", total ? `${step} / ${total}` : String(step)],
    ["epoch", epoch == null ? "–" : num(epoch, 3)],
    ["samples/s", num(samplesPerSecond(job), 3)],
    ["ETA", isFinished(job) ? "–" : duration(eta)],
    ["duration", duration(runSeconds(job))],
    ["attempts", String(job.attempts)],
    ["created", when(job.created_at)],
  ];
  return el("div.card", {}, el("h3", {}, "Progress"), bar,
    el("dl.facts", {}, facts.map(([k, v]) => [el("dt", {}, k), el("dd", { dataset: { fact: k } }, v)])));
}

function failurePanel(job) {
  if (!job.error || job.status === "succeeded") return null;
  return el(`div.failure.status-${job.status}`, { dataset: { failure: "" } },
    el("div.reason", {}, job.status === "failed" ? "Failed: " : `${job.status}: `, el("code", {}, job.error.reason || "unknown")),
    job.error.message || job.status === "failed" ? el("pre.message", {}, job.error.message || "(no message)") : null);
}

// Why a queued job has not started (its owner's running cap, a gang still forming or waiting for
// free workers): the API's `waiting`, null otherwise.
function waitingPanel(job) {
  if (!job.waiting) return null;
  return el("div.waiting", { dataset: { waiting: "" } }, el("div.reason", {}, "Not started yet"), el("p", {}, job.waiting));
}

function cancelControl(job, refresh) {
  if (isFinished(job)) return null;
  const box = el("span.cancel");
  const ask = el("button.danger", { onclick: () => box.replaceChildren(
    "Cancel this job? ",
    el("button.danger", { onclick: async () => {
      box.replaceChildren("cancelling…");
      try { await request(`/v1/jobs/${job.id}/cancel`, { method: "POST" }); } catch (e) { box.replaceChildren(e.message); }
      refresh();
    } }, "Yes, cancel"),
    el("button", { onclick: () => box.replaceChildren(ask) }, "No")) }, job.cancel_requested ? "Cancelling…" : "Cancel");
  ask.disabled = job.cancel_requested;
  box.append(ask);
  return box;
}

/** Pause (queued or running: a running job checkpoints first) or Resume (paused); nothing once it ended. */
function pauseControl(job, refresh) {
  if (isFinished(job) || job.cancel_requested) return null;
  const paused = job.status === "paused";
  const action = paused ? "resume" : "pause";
  const button = el("button", { dataset: { action }, onclick: async () => {
    button.disabled = true;
    try { await request(`/v1/jobs/${job.id}/${action}`, { method: "POST" }); } catch (e) { button.replaceWith(e.message); }
    refresh();
  } }, paused ? "Resume" : job.pause_requested ? "Pausing…" : "Pause");
  button.disabled = !paused && job.pause_requested;
  return button;
}

/** Mount the page for job `id` into `root`; the signal ends everything it started. */
export async function mountJob(root, id, signal) {
  // The job and its (thinned) series in parallel: two round trips' time, not their sum.
  const seriesLoad = loadSeries(id, signal);
  seriesLoad.catch(() => {});  // awaited below; failures surface there
  let job = await request(`/v1/jobs/${id}`, { signal });
  const header = el("div.job-header");
  const failure = el("div");
  const overview = el("div.grid2");
  const attempts = el("div");
  const controls = el("div.chart-controls");
  const charts = el("div.charts");
  const tabs = { charts: el("div", {}, controls, charts), logs: el("div"), spec: el("div"), checkpoints: el("div"),
    artifacts: el("div") };
  const tabBar = el("nav.tabs");
  const body = el("div.tab-body");
  root.replaceChildren(header, failure, overview, attempts, tabBar, body);

  let active = location.hash.split("/")[3] || "charts";
  const started = new Set();
  function show(name) {
    active = name;
    tabBar.querySelectorAll("a").forEach((a) => a.classList.toggle("active", a.dataset.tab === name));
    body.replaceChildren(tabs[name]);
    if (name === "logs" && !started.has("logs")) { started.add("logs"); tabs.logs.append(logsPanel(id, () => job, signal)); }
    if (name === "artifacts") artifactsPanel(id, signal).then((n) => tabs.artifacts.replaceChildren(n)).catch(() => {});
    if (name === "checkpoints" && state) loadCheckpoints();  // (before that, the series load lists them)
    history.replaceState(null, "", `#/jobs/${id}/${name}`);
  }
  for (const name of Object.keys(tabs)) {
    tabBar.append(el("a", { href: "#", dataset: { tab: name }, onclick: (e) => { e.preventDefault(); show(name); } }, name));
  }

  let headerState = "";
  function render() {
    // The header is rebuilt only when what it shows changes: a poll must not close an open
    // "Cancel this job?" confirmation under the user's pointer.
    const shown = `${job.status}|${job.cancel_requested}|${job.pause_requested}`;
    if (shown !== headerState) renderHeader();
    headerState = shown;
    renderBody();
  }
  function renderHeader() {
    header.replaceChildren(el("h2", {}, job.name, " ", statusBadge(job)),
      el("div.actions", {}, el("code.muted", {}, job.id), " ", pauseControl(job, refresh), cancelControl(job, refresh),
        el("a.button", { href: `#/submit/${job.id}` }, "Clone"),
        el("a.button", { href: `#/compare/${job.id}` }, "Compare…")));
  }
  function renderBody() {
    // Each part drawn again only where it changed (util.js): a poll keeps a selection in the spec.
    replaceIfChanged(failure, [failurePanel(job), waitingPanel(job)].filter(Boolean));
    const latest = Object.entries(job.final_metrics || job.latest_metrics || {}).filter(([, v]) => typeof v === "number");
    replaceIfChanged(overview, [progressBlock(job),
      el("div.card", {}, el("h3", {}, "Memory"), memoryPanel(job)),
      timeCostPanel(job),
      // Always there (empty until the first point), so the charts below do not jump when it fills.
      el("div.card", {}, el("h3", {}, job.final_metrics ? "Final metrics" : "Latest metrics"),
        latest.length ? el("dl.facts", {}, latest.map(([k, v]) => [el("dt", {}, k), el("dd", {}, num(v))]))
          : el("p.muted", {}, "none yet")),
      autoPanel(job), trackersPanel(job), lineagePanel(job), nodesPanel(job)].filter(Boolean));
    replaceIfChanged(tabs.spec, [specPanel(job)]);
    replaceIfChanged(attempts, [attemptsPanel(statusEvents, job.retries)]);
  }
  // Status events stream in for as long as the job runs (the stream ends after its final status).
  const statusEvents = [];
  followStatusEvents(id, signal, (event) => { statusEvents.push(event); renderBody(); }).catch(() => {});

  // Charts: thinned history first, then each new point as its event arrives on the job's stream.
  const view = { smoothing: 0.6, log: false };
  const drawn = new Map();
  const slider = el("input", { type: "range", min: "0", max: "0.99", step: "0.01", value: String(view.smoothing),
    oninput: () => { view.smoothing = +slider.value; label.textContent = slider.value; redraw(); } });
  const label = el("span", {}, slider.value);
  const logBox = el("input", { type: "checkbox", onchange: () => { view.log = logBox.checked; redraw(); } });
  controls.append(el("label", {}, "smoothing ", slider, " ", label), el("label", {}, logBox, " log scale"));
  function redraw() { drawn.forEach((chart) => chart.setView(view)); }
  let state;
  function updateCharts() {
    const names = chartOrder([...state.series.keys()]);
    for (const name of names) {
      const fraction = isFraction(name, [job]);
      const isNew = !drawn.has(name);
      if (isNew) drawn.set(name, createChart(charts, { title: name.replaceAll("_", " "), name, labels: [name], fraction, ...view }));
      const s = state.series.get(name);
      drawn.get(name).set(s.steps, [s.values]);
      if (isNew && marksCheckpoints(name)) drawn.get(name).setMarkers(checkpointMarkers(checkpointList));
    }
    if (!names.length) charts.replaceChildren(el("p.muted", { dataset: { noMetrics: "" } }, "No metrics yet."));
    else charts.querySelector("[data-no-metrics]")?.remove();
  }
  signal.addEventListener("abort", () => { drawn.forEach((c) => c.destroy()); drawn.clear(); });
  // Points of one burst (the worker writes events in batches) drawn once, in the next frame.
  let drawPending = false;
  function pointsArrived() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => { drawPending = false; if (!signal.aborted) updateCharts(); });
  }

  // Checkpoints: listed once the series are loaded (a checkpoint completed after that comes as an event
  // on the points' stream), and again on each `checkpoint` event; calls made meanwhile coalesce.
  let checkpointList = null, listing = false, listAgain = false;
  async function loadCheckpoints() {
    if (listing) { listAgain = true; return; }
    listing = true;
    try {
      checkpointList = await request(`/v1/jobs/${id}/checkpoints`, { signal });
      tabs.checkpoints.replaceChildren(checkpointsTable(id, checkpointList));
      drawn.forEach((chart, name) => { if (marksCheckpoints(name)) chart.setMarkers(checkpointMarkers(checkpointList)); });
    } catch (error) {
      if (!signal.aborted) tabs.checkpoints.replaceChildren(el("p.error", {}, `Could not list checkpoints: ${error.message}`));
    } finally {
      listing = false;
    }
    if (listAgain && !signal.aborted) { listAgain = false; loadCheckpoints(); }
  }

  async function refresh() {
    if (signal.aborted) return;
    job = await request(`/v1/jobs/${id}`, { signal });
    render();
  }

  render();
  show(tabs[active] ? active : "charts");
  state = await seriesLoad;
  updateCharts();
  loadCheckpoints();
  // Marked once the frame with the charts is painted (bench/bench_dashboard.py measures up to here).
  await new Promise((resolve) => requestAnimationFrame(() => resolve()));
  performance.mark("tj-charts-drawn");
  root.dataset.chartsReady = "1";

  // Live: new points come over the event stream, from the load's last seq (it also brings those of a
  // job that ended just after the load). A second stream beside the attempts' one, because that one
  // replays from the start, and a long run's metric events are what the thinned load is for. Only a
  // refused stream (over the owner's stream limit) falls back to fetching new points with each poll.
  let streaming = true;
  followPoints(id, state, signal, pointsArrived, loadCheckpoints).catch(() => { streaming = false; });
  // The job itself (progress, status) is polled until it has ended (one last pass after the end).
  let timer = null;
  async function tick() {
    try {
      const wasFinished = isFinished(job);
      await refresh();
      if (!streaming && await appendNew(id, state, signal)) updateCharts();
      if (wasFinished && isFinished(job)) return;
    } catch (error) {
      if (signal.aborted) return;
    }
    timer = setTimeout(tick, POLL_MS);
  }
  timer = setTimeout(tick, POLL_MS);
  signal.addEventListener("abort", () => clearTimeout(timer));
}
