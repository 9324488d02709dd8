// The submit page: edit a JSON or YAML spec (from the docs' example or a cloned job), see the memory
// estimate against a GPU size as you type, apply one of the planner's suggestions, upload a dataset,
// submit. YAML goes through the vendored js-yaml (api/static/vendor/js-yaml/), loaded by this page only.
import { ApiError, exampleJob, readingOrder, request } from "./api.js";
import { stackedBar } from "./panels.js";
import { bytes, debounce, el, setPath } from "./util.js";

const GPU_SIZES = [4, 8, 12, 16, 24, 40, 48, 80];
const NOT_SPEC = ["priority", "queue"];  // JobCreate's own fields: not part of the spec the estimator takes

/** The 1-based line of the text (JSON or YAML) where `field` ("training.learning_rate") is most likely written. */
export function lineOf(text, field) {
  const parts = (field || "").split(".").filter((p) => !/^\d+$/.test(p));
  let from = -1;
  for (const part of parts) {
    const name = part.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    // A JSON key ("part") or a YAML one (part: at the start of a line), the first after the parent's.
    const key = new RegExp(`"${name}"|^[ \\t-]*${name}\\s*:`, "gm");
    key.lastIndex = Math.max(from, 0);
    const found = key.exec(text);
    if (!found) break;
    from = found.index + found[0].search(/\S/);
  }
  return from >= 0 ? text.slice(0, from).split("\n").length : null;
}

let yamlLib = null;
/** The vendored js-yaml (its UMD build sets `window.jsyaml`), loaded once, on first use. */
function loadYaml() {
  yamlLib ||= new Promise((resolve, reject) => {
    document.head.append(el("script", { src: "/static/vendor/js-yaml/js-yaml.min.js",
      onload: () => resolve(window.jsyaml), onerror: () => reject(new Error("could not load the YAML parser")) }));
  });
  return yamlLib;
}

/** JSON when the text is a JSON object, else YAML (JSON is read by JSON.parse for its messages). */
export function isJsonText(text) { return text.trimStart().startsWith("{"); }

/** `spec` as text in the editor's format: JSON, or YAML in reading order with no line folding. */
function formatSpec(spec, asYaml, yaml) {
  return asYaml ? yaml.dump(spec, { lineWidth: -1, noRefs: true, sortKeys: false }) : JSON.stringify(spec, null, 2);
}

export async function mountSubmit(root, cloneId, signal) {
  const yamlLoad = loadYaml();
  yamlLoad.catch(() => {});  // awaited below
  let start;
  if (cloneId) {
    const job = await request(`/v1/jobs/${cloneId}`, { signal });
    start = readingOrder({ ...job.spec, name: `${job.name}-clone`, priority: job.priority });
  } else {
    start = await exampleJob();
  }
  const yaml = await yamlLoad;
  const editor = el("textarea.editor", { spellcheck: false, name: "spec", rows: 30, wrap: "off" });
  editor.value = JSON.stringify(start, null, 2);
  // Show the same spec in the other format (a parse error stays in the Problems list).
  const format = (asYaml) => () => {
    const spec = parsed();
    if (!spec) return;
    editor.value = formatSpec(spec, asYaml, yaml);
    drawGutter();
    check();
  };
  const formats = el("span.formats", {}, el("button", { name: "as-json", onclick: format(false) }, "JSON"),
    el("button", { name: "as-yaml", onclick: format(true) }, "YAML"));
  // Line numbers beside the text, with the lines a problem names marked: the error next to its field.
  const gutter = el("pre.gutter", { ariaHidden: "true" });
  let marked = new Map();
  function drawGutter() {
    const count = editor.value.split("\n").length;
    gutter.replaceChildren(...Array.from({ length: count }, (_, i) => {
      const problem = marked.get(i + 1);
      return el(problem ? "span.bad" : "span", { title: problem || "" }, `${i + 1}\n`);
    }));
    gutter.scrollTop = editor.scrollTop;
  }
  editor.addEventListener("scroll", () => { gutter.scrollTop = editor.scrollTop; });
  const gpu = el("select", { name: "gpu" }, GPU_SIZES.map((g) => el("option", { value: g, selected: g === 16 }, `${g} GB`)));
  const errors = el("ul.field-errors", { dataset: { fieldErrors: "" } });
  const verdict = el("div.verdict", { dataset: { verdict: "" } }, "…");
  const breakdown = el("div");
  const suggestions = el("ol.suggestions", { dataset: { suggestions: "" } });
  const submitNote = el("span.muted");
  const submit = el("button.primary", { onclick: () => send() }, "Submit job");
  const upload = uploadBox(editor, () => parsed(), (spec) => {
    editor.value = formatSpec(spec, !isJsonText(editor.value), yaml);
    check();
  });
  root.replaceChildren(el("h2", {}, cloneId ? "Submit (cloned)" : "Submit a job"),
    el("div.submit-grid", {},
      el("div", {}, el("p.muted", {}, "The job spec as JSON or YAML (fields as in the API docs). ", formats),
        el("div.editor-frame", {}, gutter, editor),
        el("div.toolbar", {}, submit, submitNote)),
      el("div", {}, el("div.card", {}, el("h3", {}, "Memory"), el("label", {}, "GPU memory per device ", gpu),
        verdict, breakdown, el("h4", {}, "Suggestions"), suggestions),
        el("div.card", {}, el("h3", {}, "Problems"), errors),
        el("div.card", {}, el("h3", {}, "Upload a dataset"), upload))));

  function parsed() {
    const asJson = isJsonText(editor.value);
    try {
      const spec = asJson ? JSON.parse(editor.value) : yaml.load(editor.value, { schema: yaml.CORE_SCHEMA });
      if (spec && typeof spec === "object" && !Array.isArray(spec)) return spec;
      throw new Error("the spec must be a mapping of fields (name, task, model, …)");
    } catch (error) {
      showErrors([{ field: asJson ? "(JSON)" : "(YAML)", message: error.message }]);
      return null;
    }
  }
  function showErrors(list) {
    marked = new Map();
    errors.replaceChildren(...list.map((e) => {
      const line = lineOf(editor.value, e.field);
      if (line) marked.set(line, `${e.field}: ${e.message}`);
      return el("li", {}, el("code", {}, e.field || "spec"), line ? el("span.muted", {}, ` line ${line}`) : "", ": ", e.message);
    }));
    if (!list.length) errors.replaceChildren(el("li.muted", {}, "none"));
    drawGutter();
  }
  function apply(changes) {
    const spec = parsed();
    if (!spec) return;
    for (const [path, value] of Object.entries(changes)) setPath(spec, path, value);
    editor.value = formatSpec(spec, !isJsonText(editor.value), yaml);
    drawGutter();
    check();
  }

  let seq = 0;
  // The verdict on screen always belongs to the text on screen: cleared at once on every edit.
  function stale() {
    seq += 1;
    verdict.className = "verdict";
    verdict.textContent = "estimating…";
    delete verdict.dataset.total;
  }
  async function check() {
    const spec = parsed();
    if (!spec) { stale(); verdict.textContent = "fix the spec's syntax to see an estimate"; return; }
    stale();
    const mine = seq;
    const body = { spec: Object.fromEntries(Object.entries(spec).filter(([k]) => !NOT_SPEC.includes(k))),
      gpu_memory_gb: +gpu.value };
    try {
      const answer = await request("/v1/estimates", { method: "POST", json: body, signal });
      if (mine !== seq) return;
      showErrors([]);
      const { estimate, plan } = answer;
      verdict.className = `verdict ${estimate.fits ? "fits" : "no-fit"}`;
      verdict.dataset.total = String(estimate.total_bytes);
      verdict.textContent = `${estimate.fits ? "fits" : "does not fit"}: ${bytes(estimate.total_bytes)} of ${gpu.value} GB`;
      breakdown.replaceChildren(stackedBar(estimate));
      const entries = estimate.fits ? [] : plan?.entries || [];
      suggestions.replaceChildren(...entries.slice(0, 5).map((entry) => el("li", {}, entry.reason, " ",
        el("button", { onclick: () => apply(entry.changes) }, "Apply"))));
      if (!entries.length) {
        suggestions.append(el("li.muted", {}, estimate.fits ? "none needed" : "nothing fits this budget; try a larger GPU"));
      }
    } catch (error) {
      if (mine !== seq || signal.aborted) return;
      verdict.className = "verdict";
      verdict.textContent = "no estimate";
      breakdown.replaceChildren();
      suggestions.replaceChildren();
      showErrors(error instanceof ApiError && error.errors.length
        ? error.errors.map((e) => ({ ...e, field: (e.field || "").replace(/^spec\./, "") }))
        : [{ field: "", message: error.message }]);
    }
  }
  async function send() {
    const spec = parsed();
    if (!spec) return;
    submit.disabled = true;
    submitNote.textContent = "submitting…";
    try {
      const job = await request("/v1/jobs", { method: "POST", json: spec, signal });
      location.hash = `#/jobs/${job.id}`;
    } catch (error) {
      submitNote.textContent = error.message;
      if (error instanceof ApiError) showErrors(error.errors.length ? error.errors : [{ field: "", message: error.message }]);
    } finally {
      submit.disabled = false;
    }
  }
  const later = debounce(check, 400);
  editor.addEventListener("input", () => { stale(); drawGutter(); later(); });
  gpu.addEventListener("change", check);
  showErrors([]);
  check();
}

function uploadBox(editor, parsed, replace) {
  const file = el("input", { type: "file", name: "file", accept: ".csv,.jsonl,.json,.parquet,.zip" });
  const name = el("input", { type: "text", name: "dataset-name", placeholder: "name (optional)" });
  const result = el("div.muted");
  const button = el("button", { onclick: async () => {
    if (!file.files.length) { result.textContent = "choose a file first"; return; }
    const form = new FormData();
    form.append("file", file.files[0]);
    if (name.value.trim()) form.append("name", name.value.trim());
    result.textContent = "uploading…";
    try {
      const dataset = await request("/v1/datasets", { method: "POST", body: form });
      result.replaceChildren(`stored as ${dataset.id} (${dataset.format}, ${bytes(dataset.size_bytes)}) `,
        el("button", { onclick: () => {
          const spec = parsed();
          if (!spec) return;
          const { text_column, label_column } = spec.dataset || {};
          spec.dataset = { id: dataset.id, text_column, label_column };
          replace(spec);
        } }, "Use in the spec"));
    } catch (error) {
      result.textContent = error.message;
    }
  } }, "Upload");
  return el("div", {}, file, name, button, result);
}
