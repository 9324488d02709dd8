// Server-sent events over fetch. EventSource cannot send the Authorization header (the key never goes
// in a URL), so this reader does what EventSource would: the event-stream rules (`id` kept across
// frames, `event`, multi-line `data` joined with "\n", comments such as the `: ping` keep-alive, CR,
// LF or CRLF line ends) and reconnection with `Last-Event-ID`, so a dropped connection resumes after
// the last whole event received: nothing shown twice, nothing missed.
import { ApiError, request } from "./api.js";

const FIRST_RETRY_MS = 250;  // the Python client's backoff: 0.25 s doubling to 5 s, reset by each event
const LAST_RETRY_MS = 5000;

/** A feed(text) function: pass it the stream's text as it arrives; it calls `onEvent({id, event, data})`
 * once per complete frame (a frame cut off before its blank line never is, so its id is not taken). */
export function eventParser(onEvent) {
  let buffer = "";
  let data = [];
  let event = "";
  let id = null;
  function line(text) {
    if (text === "") {
      if (data.length) onEvent({ id, event: event || "message", data: data.join("\n") });
      data = [];
      event = "";
      return;
    }
    if (text.startsWith(":")) return;
    const colon = text.indexOf(":");
    const field = colon < 0 ? text : text.slice(0, colon);
    let value = colon < 0 ? "" : text.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") data.push(value);
    else if (field === "event") event = value;
    else if (field === "id" && !value.includes("\0")) id = value;
  }
  return (text) => {
    buffer += text;
    // A chunk may end between the CR and the LF of one line end: keep a trailing CR for the next.
    const end = buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
    const lines = buffer.slice(0, end).split(/\r\n|\r|\n/);
    buffer = lines.pop() + buffer.slice(end);
    lines.forEach(line);
  };
}

function pause(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

/** Follow the event stream at `path` until `ended()` (asked when the server ends a stream) says it is
 * over or `signal` aborts. A dropped connection, or a 502/503/504, is retried with `Last-Event-ID`;
 * other error answers reject with ApiError. The page keeps trying while it is open, as EventSource does. */
export async function followEvents(path, { signal, onEvent, ended }) {
  let lastId = null;
  let delay = FIRST_RETRY_MS;
  while (!signal.aborted) {
    try {
      const headers = lastId === null ? {} : { "Last-Event-ID": lastId };
      const response = await request(path, { signal, raw: true, headers });
      // A new parser per connection: a half frame of the dropped one must not join the resumed one.
      const feed = eventParser((event) => {
        if (event.id !== null) lastId = event.id;
        delay = FIRST_RETRY_MS;
        onEvent(event);
      });
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        feed(value);
      }
      // The server ends a stream after the job's final status; a restarting API may end it sooner.
      if (await ended()) return;
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiError && ![502, 503, 504].includes(error.status)) throw error;
    }
    await pause(delay, signal);
    delay = Math.min(delay * 2, LAST_RETRY_MS);
  }
}
