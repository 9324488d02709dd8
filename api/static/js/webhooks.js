// The webhooks page (#/webhooks): the caller's webhooks (every owner's for an admin), a form to add one
// (its signing secret is shown once, as the API returns it once), and each webhook's recent deliveries
// with their attempts, refreshed while the page is open. Event types come from the OpenAPI document,
// so the page keeps no copy of the server's list.
import { request, schema } from "./api.js";
import { el, replaceIfChanged, when } from "./util.js";

const POLL_MS = 5000;
const DELIVERIES = 20;

/** The event types a webhook may ask for: the enum behind WebhookCreate.events in /openapi.json. */
async function eventTypes() {
  const doc = await schema();
  let items = doc.components.schemas.WebhookCreate?.properties?.events?.items || {};
  if (items.$ref) items = doc.components.schemas[items.$ref.split("/").pop()];
  return items.enum || [];
}

function lastAttempt(delivery) {
  const log = delivery.attempt_log || [];
  const last = log[log.length - 1];
  if (!last) return el("span.muted", {}, "not tried yet");
  const outcome = last.status_code != null ? `HTTP ${last.status_code}` : last.error || "error";
  return el("span", { title: last.error || "" }, outcome, el("span.muted", {}, ` · ${when(last.at)}`));
}

function deliveriesTable(hook, page, onRedeliver) {
  if (!page.items.length) return el("p.muted", { dataset: { deliveries: "0" } }, "No deliveries yet.");
  return el("table.deliveries", { dataset: { deliveries: String(page.items.length) } },
    el("thead", {}, el("tr", {}, ["event", "job", "state", "attempts", "last attempt", "created", ""].map((h) => el("th", {}, h)))),
    el("tbody", {}, page.items.map((d) => el("tr", { dataset: { delivery: d.id, state: d.state } },
      el("td", {}, d.event_type),
      el("td", {}, d.job_id ? el("a", { href: `#/jobs/${d.job_id}` }, d.job_id.slice(0, 8)) : "–"),
      el("td", {}, el(`span.badge.delivery-${d.state}`, {}, d.state),
        d.state === "pending" && d.attempts ? el("div.muted.small", {}, `next ${when(d.next_attempt_at)}`) : null),
      el("td.num", {}, String(d.attempts)),
      el("td", {}, lastAttempt(d)),
      el("td", { title: d.created_at }, when(d.created_at)),
      el("td", {}, el("button.small", { onclick: () => onRedeliver(hook, d) }, "Redeliver"))))));
}

function hookCard(hook, page, actions) {
  const state = hook.enabled ? el("span.badge.status-succeeded", {}, "enabled")
    : el("span.badge.status-failed", { title: hook.disabled_reason || "" }, "disabled");
  return el("section.card.webhook", { dataset: { webhook: hook.id } },
    el("div.toolbar", {}, el("code", {}, hook.url), state,
      el("button", { onclick: () => actions.rotate(hook) }, "Rotate secret"),
      el("button.danger", { onclick: () => actions.remove(hook) }, "Delete")),
    el("p.muted.small", {}, hook.events.join(", "), hook.description ? ` · ${hook.description}` : "",
      ` · ${hook.owner} · created ${when(hook.created_at)}`),
    hook.disabled_reason ? el("p.error", {}, hook.disabled_reason) : null,
    page ? deliveriesTable(hook, page, actions.redeliver) : el("p.muted", {}, "loading deliveries…"));
}

function createForm(types, onCreated) {
  const url = el("input", { type: "url", name: "url", placeholder: "receiver URL (https)", size: 48, required: true });
  const description = el("input", { type: "text", name: "description", placeholder: "description", size: 30 });
  const boxes = types.map((t) => el("input", { type: "checkbox", name: "event", value: t, checked: t.startsWith("job.") && t !== "job.queued" }));
  const note = el("div.error");
  const form = el("form.webhook-create", { onsubmit: async (event) => {
    event.preventDefault();
    note.replaceChildren();
    try {
      const created = await request("/v1/webhooks", { method: "POST", json: {
        url: url.value.trim(), description: description.value, events: boxes.filter((b) => b.checked).map((b) => b.value) } });
      url.value = ""; description.value = "";
      onCreated(created);
    } catch (error) {
      note.append(error.message, ...error.errors.map((e) => el("div", {}, `${e.field}: ${e.message}`)));
    }
  } },
  el("h3", {}, "Add a webhook"), el("div.toolbar", {}, url, description),
  el("div.events", {}, boxes.map((b) => el("label", {}, b, ` ${b.value}`))),
  el("button.primary", { type: "submit" }, "Add"), note);
  return form;
}

/** The secret of a webhook just created or rotated: shown once, with how receivers use it. */
function secretNotice(hook) {
  return el("div.card.secret", { dataset: { secretFor: hook.id } },
    el("p", {}, "Signing secret for ", el("code", {}, hook.url), " (shown once; store it with the receiver):"),
    el("pre", {}, hook.secret),
    el("p.muted.small", {}, "Verify each delivery's webhook-signature header with it (README, Integrations)."));
}

export async function mountWebhooks(root, signal) {
  const types = await eventTypes();
  const notice = el("div");
  const list = el("div.webhooks");
  const pages = new Map();
  let hooks = [], timer = null;
  // A button's request that fails (the webhook deleted meanwhile, a 409, the network) is said above
  // the list: an onclick's rejected promise would otherwise vanish, and the button seem to do nothing.
  const said = (action) => async (...args) => {
    try { await action(...args); } catch (error) {
      if (!signal.aborted) notice.replaceChildren(el("p.error", {}, error.message));
    }
  };
  const actions = {
    async rotate(hook) {
      const rotated = await request(`/v1/webhooks/${hook.id}/rotate-secret`, { method: "POST", signal });
      notice.replaceChildren(secretNotice(rotated));
    },
    async remove(hook) {
      if (!confirm(`Delete the webhook to ${hook.url} and its deliveries?`)) return;
      await request(`/v1/webhooks/${hook.id}`, { method: "DELETE", signal });
      await load();
    },
    async redeliver(hook, delivery) {
      await request(`/v1/webhooks/${hook.id}/deliveries/${delivery.id}/redeliver`, { method: "POST", signal });
      await load();
    },
  };
  for (const name of Object.keys(actions)) actions[name] = said(actions[name]);
  function render() {
    replaceIfChanged(list, hooks.length ? hooks.map((h) => hookCard(h, pages.get(h.id), actions))
      : [el("p.muted", {}, "No webhooks yet.")]);
  }
  async function load() {
    hooks = (await request("/v1/webhooks", { signal })).items;
    render();
    await Promise.all(hooks.map(async (h) => {
      pages.set(h.id, await request(`/v1/webhooks/${h.id}/deliveries?limit=${DELIVERIES}`, { signal }));
    }));
    render();
  }
  async function tick() {
    try { await load(); } catch (error) { if (!signal.aborted) notice.replaceChildren(el("p.error", {}, error.message)); }
    if (!signal.aborted) timer = setTimeout(tick, POLL_MS);
  }
  root.replaceChildren(el("h2", {}, "Webhooks"),
    el("p.muted", {}, "Signed job and checkpoint events, delivered at least once (README, Integrations)."),
    notice, createForm(types, async (created) => { notice.replaceChildren(secretNotice(created)); await load(); }), list);
  signal.addEventListener("abort", () => clearTimeout(timer));
  await tick();
}
