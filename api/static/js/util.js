// Small helpers shared by the views: building elements, formatting numbers and times, YAML output.

/** el("div.card", {onclick}, child, "text", ...): an element with classes, properties and children. */
export function el(tag, props = {}, ...children) {
  const [name, ...classes] = tag.split(".");
  const node = document.createElement(name);
  if (classes.length) node.className = classes.join(" ");
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key in node && key !== "list") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const shownAs = (node) => node.outerHTML ?? node.textContent;

/** `parent`'s children become `nodes`, keeping each child that would show the same as one of them
 * (matched by its HTML, wherever it stood) and leaving in place every child already where it belongs.
 * A page that redraws on a timer then keeps the elements a person is using, also in a list where one
 * row changed: a press and a release that land on a button and on its redrawn copy make no click, and
 * a selection, a checked box or the focus would go with the old element. */
export function replaceIfChanged(parent, nodes) {
  const spare = new Map();
  for (const child of parent.childNodes) spare.set(shownAs(child), [...(spare.get(shownAs(child)) || []), child]);
  const wanted = nodes.map((node) => spare.get(shownAs(node))?.shift() ?? node);
  wanted.forEach((node, i) => { if (parent.childNodes[i] !== node) parent.insertBefore(node, parent.childNodes[i] ?? null); });
  while (parent.childNodes.length > wanted.length) parent.lastChild.remove();
}

export function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i && n < 10 ? 2 : i ? 1 : 0)} ${units[i]}`;
}

export function duration(seconds) {
  if (seconds == null || !isFinite(seconds)) return "–";
  seconds = Math.max(0, Math.round(seconds));
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  return h ? `${h}h ${String(m).padStart(2, "0")}m` : m ? `${m}m ${String(s).padStart(2, "0")}s` : `${s}s`;
}

export function when(iso) {
  if (!iso) return "–";
  const date = new Date(iso);
  const ago = (Date.now() - date.getTime()) / 1000;
  if (ago < 60) return "just now";
  if (ago < 86400) return `${duration(ago)} ago`;
  return date.toLocaleString();
}

export function num(value, digits = 4) {
  if (value == null) return "–";
  if (typeof value !== "number") return String(value);
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e5)) return value.toExponential(2);
  return String(+value.toPrecision(digits));
}

/** Seconds the job has run (until now when it still runs). */
export function runSeconds(job) {
  if (!job.started_at) return null;
  const end = job.finished_at ? new Date(job.finished_at) : new Date();
  return (end - new Date(job.started_at)) / 1000;
}

/** Optimizer steps per second and the time left, from the start time and progress so far. */
export function pace(job) {
  const seconds = runSeconds(job), { step, total } = job.progress;
  if (!seconds || !step) return { stepsPerSecond: null, eta: null };
  const stepsPerSecond = step / seconds;
  const eta = total && !job.finished_at ? (total - step) / stepsPerSecond : null;
  return { stepsPerSecond, eta };
}

/** Samples per second: steps/s times the samples one optimizer step consumes (from the spec). */
export function samplesPerSecond(job) {
  const { stepsPerSecond } = pace(job);
  if (!stepsPerSecond) return null;
  const spec = job.spec || {};
  const perStep = (spec.training?.per_device_train_batch_size ?? 8) *
    (spec.efficiency?.gradient_accumulation_steps ?? 1) * (spec.resources?.num_processes ?? 1);
  return stepsPerSecond * perStep;
}

export function debounce(fn, ms) {
  let timer = null;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

const PLAIN = /^[A-Za-z0-9_./@-][A-Za-z0-9_ ./@-]*$/;
function scalar(value) {
  if (value === null) return "null";
  if (typeof value === "string") {
    const reserved = /^(true|false|null|yes|no|on|off|~|[-+.\d].*)$/i.test(value);
    return PLAIN.test(value) && !reserved && !value.endsWith(" ") ? value : JSON.stringify(value);
  }
  return String(value);
}

/** YAML for JSON data (what the spec is): block style, strings quoted when YAML would misread them. */
export function toYaml(value, indent = "") {
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return value.map((item) => {
      const inner = toYaml(item, indent + "  ");
      return `${indent}- ${typeof item === "object" && item !== null ? inner.trimStart() : inner}`;
    }).join("\n");
  }
  if (value && typeof value === "object") {
    const entries = Object.entries(value);
    if (!entries.length) return "{}";
    return entries.map(([key, item]) => {
      const label = `${indent}${scalar(key)}:`;
      if (item && typeof item === "object" && Object.keys(item).length) return `${label}\n${toYaml(item, indent + "  ")}`;
      return `${label} ${toYaml(item, indent + "  ")}`;
    }).join("\n");
  }
  return scalar(value);
}

/** {"a": {"b": 1}} -> {"a.b": 1}: the dotted paths the server names fields by. */
export function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const [key, item] of Object.entries(value)) flatten(item, prefix ? `${prefix}.${key}` : key, out);
  } else if (prefix) {
    out[prefix] = value;
  }
  return out;
}

/** Set `path` ("training.per_device_train_batch_size") in `target`, creating objects on the way. */
export function setPath(target, path, value) {
  const parts = path.split(".");
  let node = target;
  for (const part of parts.slice(0, -1)) {
    if (typeof node[part] !== "object" || node[part] === null) node[part] = {};
    node = node[part];
  }
  node[parts[parts.length - 1]] = value;
}

export function statusBadge(job) {
  const badge = el(`span.badge.status-${job.status}`, {}, job.status);
  if (job.cancel_requested && !job.finished_at) badge.append(" (cancelling)");
  else if (job.pause_requested && job.status === "running") badge.append(" (pausing)");
  return badge;
}
