// Metric charts on uPlot (vendored, api/static/vendor/uplot): one chart per metric against step,
// raw values faint and the smoothed line on top, optional log scale. uPlot draws 100k points in a
// few ms, and the server thins long series first (GET /metrics?max_points=), so big runs stay fast.
// Our own legend and tick labels replace uPlot's: its legend shows `--` rows until hovered, and its
// ticks keep three decimals, so a learning rate of 5e-5 read `0`.
/* global uPlot */
import { el, num } from "./util.js";

export const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
const MARKER = "#94a3b8";
const BEST_MARKER = "#059669";

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

/** Tick labels as precise as the spacing `incr` needs: 5e-5 and 2.5e-5 for a learning rate, 0.6931 and
 * 0.6932 for a flat loss, 9,000,000 for a diverging one. */
function tickLabels(splits, incr) {
  const largest = Math.max(0, ...splits.map((v) => Math.abs(v ?? 0)));
  const scientific = largest > 0 && largest < 1e-3;
  // One digit below the spacing's first, for spacings such as 2.5 or 0.25.
  const unit = isFinite(incr) && incr > 0 ? 10 ** (Math.floor(Math.log10(incr)) - 1) : null;
  return splits.map((v) => {
    if (v == null) return "";
    const rounded = +(unit ? Math.round(v / unit) * unit : v).toPrecision(unit ? 12 : 4);
    if (rounded === 0) return "0";
    if (scientific) return rounded.toExponential().replace("e+", "e");
    const digits = unit ? Math.min(20, Math.max(0, Math.round(-Math.log10(unit)))) : 20;
    return rounded.toLocaleString("en-US", { maximumFractionDigits: digits });
  });
}

/** Whether chart `name` (eval_f1) is a fraction in [0, 1]: one of the jobs' spec metrics (accuracy, f1,
 * precision and recall: trainer_core/metrics.py), or a preference job's share of pairs ranked right. */
export function isFraction(name, jobs) {
  const bare = name.replace(/^eval_/, "");
  return bare === "rewards/accuracies" || jobs.some((job) => (job.spec?.metrics || []).includes(bare));
}

/** uPlot's own y range, kept within [0, 1] for a fraction (accuracy, f1) whose values are in it: one
 * point at 1.0 would otherwise get an axis from 0 to 2. */
function yRange(fraction) {
  return (u, min, max) => {
    if (min == null || max == null) return [0, 1];
    const [low, high] = uPlot.rangeNum(min, max, 0.1, true);
    return fraction && min >= 0 && max <= 1 ? [Math.max(0, low), Math.min(1, high)] : [low, high];
  };
}

/** Vertical lines at `markers` ({step, best}) within the x range: dashed grey, the best solid green
 * and labelled. Returns the steps drawn. */
function drawMarkers(u, markers) {
  const { min, max } = u.scales.x;
  if (min == null || max == null) return [];
  const shown = markers.filter((m) => m.step >= min && m.step <= max);
  const { ctx, bbox } = u;
  const ratio = window.devicePixelRatio || 1;
  ctx.save();
  for (const marker of [...shown].sort((a, b) => a.best - b.best)) {  // the best drawn last, on top
    const x = Math.round(u.valToPos(marker.step, "x", true));
    ctx.strokeStyle = marker.best ? BEST_MARKER : MARKER;
    ctx.lineWidth = (marker.best ? 2 : 1) * ratio;
    ctx.setLineDash(marker.best ? [] : [4 * ratio, 3 * ratio]);
    ctx.beginPath();
    ctx.moveTo(x, bbox.top);
    ctx.lineTo(x, bbox.top + bbox.height);
    ctx.stroke();
    if (marker.best) {
      ctx.fillStyle = BEST_MARKER;
      ctx.font = `${11 * ratio}px system-ui, sans-serif`;
      ctx.textAlign = "left";  // (uPlot leaves the axes' alignment set)
      ctx.textBaseline = "top";
      ctx.fillText("best", x + 3 * ratio, bbox.top + 2 * ratio);
    }
  }
  ctx.restore();
  return shown;
}

/**
 * A chart in `host` for `labels.length` series sharing one x (step) axis; `fraction` keeps its y axis
 * within [0, 1]. set(xs, [ys...]) replaces the data; setView({smoothing, log}) redraws; setMarkers([{step,
 * best}]) draws checkpoint lines; destroy() frees it. The frame's data attributes say what it shows
 * (points, y range, y tick labels, marker steps and the best's) for tests and benches.
 */
export function createChart(host, { title, labels, smoothing = 0, log = false, name, fraction = false }) {
  const frame = el("div.chart", { dataset: { chart: name || title, points: "0" } }, el("h4", {}, title));
  const plotHost = el("div.plot");
  const legend = chartLegend(labels);
  frame.append(plotHost, legend.node);
  host.append(frame);
  let xs = [], raw = labels.map(() => []), view = { smoothing, log }, plot = null, columns = [[]], markers = [];

  function options() {
    const series = [{ label: "step" }];
    labels.forEach((label, i) => {
      const color = PALETTE[i % PALETTE.length];
      if (view.smoothing) series.push({ label: `${label} (raw)`, stroke: color + "40", width: 1, spanGaps: true });
      series.push({ label, stroke: color, width: 2, spanGaps: true });
    });
    return {
      width: Math.max(240, plotHost.clientWidth || 480), height: 220, series,
      scales: { x: { time: false }, y: view.log ? { distr: 3 } : { distr: 1, range: yRange(fraction) } },
      // The y axis as wide as its longest tick label, so a diverging loss's 9,000,000 is not clipped.
      axes: [{ label: "step", size: 36 }, {
        values: (u, splits, axis, space, incr) => {
          const ticks = tickLabels(splits, view.log ? null : incr);
          frame.dataset.yTicks = JSON.stringify(ticks);
          return ticks;
        },
        size: (u, values) => Math.max(48, 16 + 7 * Math.max(0, ...(values || []).map((v) => String(v).length))),
      }],
      legend: { show: false }, cursor: { drag: { x: true, y: false } },
      hooks: {
        setCursor: [(u) => showValues(u.cursor.idx)],
        setScale: [(u, key) => { if (key === "y") frame.dataset.yRange = JSON.stringify([u.scales.y.min, u.scales.y.max]); }],
        draw: [(u) => {
          const shown = drawMarkers(u, markers);
          frame.dataset.markers = JSON.stringify(shown.map((m) => m.step));
          frame.dataset.bestMarker = String(shown.find((m) => m.best)?.step ?? "");
        }],
      },
    };
  }

  /** The legend's values at data index `idx` (the cursor's), or at the latest step when not hovering. */
  function showValues(idx) {
    const at = idx ?? xs.length - 1;
    const per = view.smoothing ? 2 : 1;
    legend.show(at < 0 ? null : xs[at], labels.map((_, i) => ({
      value: columns[1 + i * per + per - 1]?.[at], raw: view.smoothing ? columns[1 + i * per]?.[at] : null,
    })), idx != null);
  }

  function data() {
    columns = [xs];
    for (const ys of raw) {
      const shown = view.log ? positiveOnly(ys) : ys;
      if (view.smoothing) columns.push(shown);
      columns.push(smooth(shown, view.smoothing));
    }
    return columns;
  }

  function update() {
    plot.setData(data());
    showValues(plot.cursor.idx);
  }

  function draw() {
    if (plot) plot.destroy();
    plot = new uPlot(options(), data(), plotHost);
    showValues(null);
  }

  const resize = new ResizeObserver(() => plot && plot.setSize({ width: Math.max(240, plotHost.clientWidth), height: 220 }));
  resize.observe(plotHost);
  draw();

  return {
    frame,
    set(newXs, newRaw) {
      xs = newXs;
      raw = newRaw;
      update();
      frame.dataset.points = String(raw.reduce((n, ys) => n + ys.filter((v) => v != null).length, 0));
    },
    setView(next) {
      const shapeChanged = next.log !== view.log || Boolean(next.smoothing) !== Boolean(view.smoothing);
      view = { ...view, ...next };
      if (shapeChanged) draw(); else update();
    },
    setMarkers(next) {
      markers = next;
      plot.redraw(false);
    },
    destroy() { resize.disconnect(); if (plot) plot.destroy(); frame.remove(); },
  };
}

/** A legend that shows only what means something: each series' name, then its value (and raw value,
 * when smoothed) at the hovered step, or at the latest step when the cursor is elsewhere. A series with
 * no value there shows its name alone; a chart with no points, names alone. */
function chartLegend(labels) {
  const step = el("span.step", { dataset: { step: "" } });
  const values = labels.map(() => el("span.value"));
  const node = el("div.chart-legend", { dataset: { legend: "" } }, step, labels.map((label, i) => el("span.series",
    { dataset: { series: label } }, el("i", { style: `background:${PALETTE[i % PALETTE.length]}` }), label, values[i])));
  return {
    node,
    show(x, points, hovered) {
      step.textContent = x == null ? "" : `${hovered ? "step" : "latest: step"} ${x}`;
      step.hidden = x == null;
      points.forEach(({ value, raw }, i) => {
        const shown = x != null && value != null;
        const rawText = raw == null || num(raw) === num(value) ? "" : ` (raw ${num(raw)})`;
        values[i].textContent = shown ? ` ${num(value)}${rawText}` : "";
        values[i].hidden = !shown;
      });
    },
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
