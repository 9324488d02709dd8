// Metric charts on uPlot (vendored, api/static/vendor/uplot): one chart per metric against step,
// raw values faint and the smoothed line on top, optional log scale. uPlot draws 100k points in a
// few ms, and the server thins long series first (GET /metrics?max_points=), so big runs stay fast.
/* global uPlot */
import { el, num } from "./util.js";

export const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

/** TensorBoard's smoothing: an exponential moving average, debiased so the start is not pulled to 0. */
export function smooth(values, weight) {
  if (!weight) return values;
  const out = new Array(values.length);
  let last = 0, n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v == null || !isFinite(v)) { out[i] = null; continue; }
    last = last * weight + (1 - weight) * v;
    n += 1;
    out[i] = last / (1 - Math.pow(weight, n));
  }
  return out;
}

function positiveOnly(values) { return values.map((v) => (v != null && v > 0 ? v : null)); }

/**
 * A chart in `host` for `labels.length` series sharing one x (step) axis.
 * set(xs, [ys...]) replaces the data; setView({smoothing, log}) redraws; destroy() frees it.
 */
export function createChart(host, { title, labels, smoothing = 0, log = false, name }) {
  const frame = el("div.chart", { dataset: { chart: name || title, points: "0" } }, el("h4", {}, title));
  const plotHost = el("div.plot");
  frame.append(plotHost);
  host.append(frame);
  let xs = [], raw = labels.map(() => []), view = { smoothing, log }, plot = null;

  function options() {
    const series = [{ label: "step" }];
    labels.forEach((label, i) => {
      const color = PALETTE[i % PALETTE.length];
      if (view.smoothing) series.push({ label: `${label} (raw)`, stroke: color + "40", width: 1, spanGaps: true });
      series.push({ label, stroke: color, width: 2, spanGaps: true, value: (u, v) => num(v) });
    });
    return {
      width: Math.max(240, plotHost.clientWidth || 480), height: 220, series,
      scales: { x: { time: false }, y: { distr: view.log ? 3 : 1 } },
      // uPlot picks tick decimals from the tick spacing: 0.6931 and 0.6932 stay apart.
      // The y axis as wide as its longest tick label, so a diverging loss's 9,000,000 is not clipped.
      axes: [{ label: "step", size: 36 }, { size: (u, values) => Math.max(48, 16 + 7 * Math.max(0, ...(values || []).map((v) => String(v).length))) }],
      legend: { live: true }, cursor: { drag: { x: true, y: false } },
    };
  }

  function data() {
    const columns = [xs];
    for (const ys of raw) {
      const shown = view.log ? positiveOnly(ys) : ys;
      if (view.smoothing) columns.push(shown);
      columns.push(smooth(shown, view.smoothing));
    }
    return columns;
  }

  function draw() {
    if (plot) plot.destroy();
    plot = new uPlot(options(), data(), plotHost);
  }

  const resize = new ResizeObserver(() => plot && plot.setSize({ width: Math.max(240, plotHost.clientWidth), height: 220 }));
  resize.observe(plotHost);
  draw();

  return {
    frame,
    set(newXs, newRaw) {
      xs = newXs;
      raw = newRaw;
      plot.setData(data());
      frame.dataset.points = String(raw.reduce((n, ys) => n + ys.filter((v) => v != null).length, 0));
    },
    setView(next) {
      const shapeChanged = next.log !== view.log || Boolean(next.smoothing) !== Boolean(view.smoothing);
      view = { ...view, ...next };
      if (shapeChanged) draw(); else plot.setData(data());
    },
    destroy() { resize.disconnect(); if (plot) plot.destroy(); frame.remove(); },
  };
}

/** Series keyed by name -> {steps: [], values: []} merged onto one x axis (null where a series has no point). */
export function alignSeries(seriesList) {
  const steps = [...new Set(seriesList.flatMap((s) => s.steps))].sort((a, b) => a - b);
  const index = new Map(steps.map((step, i) => [step, i]));
  const columns = seriesList.map((s) => {
    const ys = new Array(steps.length).fill(null);
    s.steps.forEach((step, i) => { ys[index.get(step)] = s.values[i]; });
    return ys;
  });
  return { steps, columns };
}
