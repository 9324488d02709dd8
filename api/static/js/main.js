// The dashboard's entry: login box, navigation and a hash router (#/jobs, #/jobs/ID, #/compare/A,B,
// #/submit, #/submit/ID, #/usage, #/webhooks). Each view gets an AbortController; changing views
// aborts it, which stops the previous view's timers and fetches and destroys its charts.
import { currentKey, forgetKey, onUnauthorized, request, storeKey } from "./api.js";
import { mountCompare } from "./compare.js";
import { mountJob } from "./job.js";
import { mountList } from "./list.js";
import { mountSubmit } from "./submit.js";
import { mountUsage } from "./usage.js";
import { mountWebhooks } from "./webhooks.js";
import { el } from "./util.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
let current = null;

function loginBox(message = "") {
  current?.abort();
  const key = el("input", { type: "password", name: "key", placeholder: "API key (tj_…)", autocomplete: "off", size: 40 });
  const remember = el("input", { type: "checkbox", name: "remember" });
  const note = el("p.error", {}, message);
  const form = el("form.login", { onsubmit: async (event) => {
    event.preventDefault();
    storeKey(key.value.trim(), remember.checked);
    try {
      await request("/v1/jobs?limit=1");
      route();
    } catch (error) {
      forgetKey();
      note.textContent = error.status === 401 ? "That key was not accepted." : error.message;
    }
  } },
  el("h2", {}, "Sign in"), el("p.muted", {}, "Paste an API key (from `trainjobs keys create`, or the one `trainjobs dev` prints)."),
  key, el("label", {}, remember, " remember on this computer"), el("button.primary", { type: "submit" }, "Sign in"), note);
  nav.hidden = true;
  main.replaceChildren(form);
  key.focus();
}

async function route() {
  if (!currentKey()) { loginBox(); return; }
  nav.hidden = false;
  current?.abort();
  const controller = new AbortController();
  current = controller;
  const [, view, arg] = location.hash.replace(/^#\/?/, "#/").split("/");
  main.replaceChildren(el("p.muted", {}, "loading…"));
  nav.querySelectorAll("a[data-view]").forEach((a) => a.classList.toggle("active", a.dataset.view === (view || "jobs")));
  try {
    if (view === "jobs" && arg) await mountJob(main, arg, controller.signal);
    else if (view === "compare") await mountCompare(main, (arg || "").split(",").filter(Boolean), controller.signal);
    else if (view === "submit") await mountSubmit(main, arg, controller.signal);
    else if (view === "usage") await mountUsage(main, controller.signal);
    else if (view === "webhooks") await mountWebhooks(main, controller.signal);
    else await mountList(main, controller.signal);
  } catch (error) {
    if (controller.signal.aborted || error.status === 401) return;
    main.replaceChildren(el("div.failure", {}, el("div.reason", {}, "Could not load this page"), el("pre.message", {}, error.message)));
  }
}

document.getElementById("logout").addEventListener("click", (event) => {
  event.preventDefault();
  forgetKey();
  loginBox("Signed out.");
});
onUnauthorized(() => { forgetKey(); loginBox("The key was rejected; sign in again."); });
window.addEventListener("hashchange", () => {
  // Tab switches on the job page rewrite the hash in place (replaceState): no reload for those.
  route();
});
route();
