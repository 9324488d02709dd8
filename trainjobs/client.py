"""The Python client of the trainjobs service (httpx); the CLI is built on it.

    client = Client()                      # TRAINJOBS_URL / TRAINJOBS_API_KEY
    job = client.submit("job.yaml")
    for event in client.events(job["id"]):  # reconnects with the last id; ends at the final status
        print(event.event, event.data)

Every error answer of the API becomes an :class:`ApiError` carrying its problem+json body.

A submit (:meth:`Client.submit`, :meth:`Client.upload_dataset`) carries one ``Idempotency-Key`` for all
its tries and is sent again after a connection error or a 502/503/504 (a first try that cannot connect
at all fails at once): the service answers a repeated key with the first answer, so a retry of a
submit whose answer was lost never creates a second job.
"""

from __future__ import annotations

import codecs
import io
import json
import logging
import os
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar

import httpx
import yaml
from pydantic import BaseModel

from service_core.status import TERMINAL_STATUSES
from trainjobs.sse import SseEvent, iter_events

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
STALL_TIMEOUT_S = 60.0
TERMINAL = frozenset(s.value for s in TERMINAL_STATUSES)
# Aliases: inside Client, `list` is the method, so annotations name the builtin through these.
JsonObject = dict[str, Any]
JsonList = list[JsonObject]
Item = TypeVar("Item")
# Answers after which a submit is sent again (with its key): a proxy's or the service's "try later".
RETRY_STATUSES = frozenset({502, 503, 504})
# What a stream's read timeout means (Client._resuming): the end, a dead connection, or a quiet job.
Quiet = Literal["end", "drop", "ask again"]


class TrainjobsError(Exception):
    """Base of the client's errors; ``str()`` is a message fit for a terminal."""


class ConnectionFailed(TrainjobsError):
    """The service could not be reached (or the event stream could not be resumed)."""


class ApiError(TrainjobsError):
    """An error answer of the API: the RFC 9457 problem details, with per-field ``errors``."""

    def __init__(self, status: int, body: Mapping[str, Any]):
        self.status = status
        self.body = dict(body)
        self.title = str(body.get("title") or httpx.codes.get_reason_phrase(status) or "error")
        self.detail = body.get("detail")
        raw_errors = body.get("errors") or []
        self.errors: JsonList = [dict(e) for e in raw_errors if isinstance(e, Mapping)]
        super().__init__(self.message())

    def lines(self) -> list[str]:
        """``field: message`` for each field error (the readable form the CLI prints)."""
        return [f"{e.get('field', '?')}: {e.get('message', '')}" for e in self.errors]

    def message(self) -> str:
        head = f"{self.title} ({self.status})"
        if self.detail and not self.errors:
            head += f": {self.detail}"
        return "\n".join([head, *self.lines()])

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = {"detail": response.text[:500]}
        if not isinstance(body, Mapping):
            body = {"detail": str(body)}
        return cls(response.status_code, body)


def spec_payload(spec: str | Path | Mapping[str, Any] | BaseModel) -> dict[str, Any]:
    """A spec as the JSON the API takes: a file (YAML/JSON), a dict, or a ``JobSpec``.

    A ``JobSpec`` is dumped with ``exclude_unset`` so the server sees exactly what the user set
    (some rules depend on which fields were given, e.g. Adam-only options with Adafactor).
    """
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json", exclude_unset=True)
    if isinstance(spec, Mapping):
        return dict(spec)
    text = Path(spec).read_text(encoding="utf-8")
    data = json.loads(text) if str(spec).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise TrainjobsError(f"spec: {spec} must hold one object")
    return dict(data)


def zip_folder(folder: Path) -> bytes:
    """The folder as a zip archive (relative names), the form the API takes for image/audio folders."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(folder).as_posix())
    return buffer.getvalue()


def _is_terminal(event: SseEvent) -> bool:
    return event.event == "status" and isinstance(event.data, Mapping) and event.data.get("status") in TERMINAL


class Client:
    """A session with one trainjobs service, authenticated by one API key."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        retry_max_s: float = 120.0,
    ):
        self.base_url = (base_url or os.environ.get("TRAINJOBS_URL") or DEFAULT_URL).rstrip("/")
        key = api_key if api_key is not None else os.environ.get("TRAINJOBS_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.retry_max_s = retry_max_s
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"cannot reach {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        return response

    def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        return self._request(method, url, **kwargs).json()

    def _create(self, url: str, key: str | None, **kwargs: Any) -> Any:
        """POST a submit until it is answered, every try with the same ``Idempotency-Key`` (a new one
        unless given): after a connection error or a 502/503/504 it is sent again, 0.25 s later, doubling
        up to 5 s, for up to ``retry_max_s``.

        A first try that cannot even connect fails at once: nothing was sent, and a service that is
        not there at all (a wrong URL, a stopped server) is the user's to fix, not a 2-minute wait.
        Once a try may have reached the service (or it answered 502/503/504), a restart in between is
        waited out."""
        headers = {"Idempotency-Key": key or uuid.uuid4().hex}
        delay, started, tries = 0.25, time.monotonic(), 0
        while True:
            tries += 1
            try:
                response = self._http.request("POST", url, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                failure: TrainjobsError = ConnectionFailed(f"cannot reach {self.base_url}: {exc}")
                if tries == 1 and isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    raise failure from exc
                log.debug("submit to %s failed (%s); sending it again", url, exc)
            else:
                if response.status_code < 400:
                    return response.json()
                failure = ApiError.from_response(response)
                if response.status_code not in RETRY_STATUSES:
                    raise failure
            if time.monotonic() - started > self.retry_max_s:
                raise failure
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    # jobs
    def submit(
        self,
        spec: str | Path | Mapping[str, Any] | BaseModel,
        priority: int | None = None,
        queue: str | None = None,
        *,
        dry_run: bool = False,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Submit a job (the spec plus optional priority and queue); returns the created job.

        ``dry_run``: the service runs its checks (preflight, estimate) and returns the report, storing nothing.
        A submit is retried safely (see the module docstring); ``idempotency_key`` makes several calls one
        submit (default: a new key per call).
        """
        body = spec_payload(spec)
        if priority is not None:
            body["priority"] = priority
        if queue is not None:
            body["queue"] = queue
        if dry_run:
            report: dict[str, Any] = self._json("POST", "/v1/jobs", json=body, params={"dry_run": "true"})
            return report
        result: dict[str, Any] = self._create("/v1/jobs", idempotency_key, json=body)
        return result

    def get(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{job_id}")
        return result

    def list(
        self, status: str | None = None, limit: int | None = None, owner: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Jobs newest first, following the pagination cursor; ``limit`` caps the total."""
        cursor: str | None = None
        seen = 0
        while True:
            filters = {"status": status, "owner": owner, "cursor": cursor}
            params: dict[str, Any] = {k: v for k, v in filters.items() if v}
            if limit is not None:
                params["limit"] = min(limit - seen, 100)
            page = self._json("GET", "/v1/jobs", params=params)
            for job in page.get("items", []):
                yield job
                seen += 1
                if limit is not None and seen >= limit:
                    return
            cursor = page.get("next_cursor")
            if not cursor or not page.get("items"):
                return

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Ask the service to cancel a job (202); a finished job raises ApiError(409)."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job_id}/cancel")
        return result

    def pause(self, job_id: str) -> dict[str, Any]:
        """Pause a job (202): a queued one at once, a running one after it checkpoints; 409 when it ended."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job_id}/pause")
        return result

    def resume(self, job_id: str) -> dict[str, Any]:
        """Put a paused job back on its queue (202); 409 when it is not paused."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{job_id}/resume")
        return result

    def metrics(
        self, job_id: str, after: int | None = None, name: str | None = None, page_size: int = 1000
    ) -> JsonList:
        """All metric points after seq ``after`` (optionally of one metric), in seq order."""
        points: JsonList = []
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if after is not None:
                params["after"] = after
            if name is not None:
                params["name"] = name
            page = self._json("GET", f"/v1/jobs/{job_id}/metrics", params=params)
            items = page.get("items", [])
            points.extend(items)
            next_after = page.get("next_after")
            if not items or not page.get("has_more") or next_after is None or next_after == after:
                return points
            after = int(next_after)

    def events(
        self, job_id: str, last_event_id: int | str | None = None, idle_timeout: float | None = None
    ) -> Iterator[SseEvent]:
        """The job's events over SSE, from after ``last_event_id``, until its terminal status.

        A dropped connection (or an API restart) is resumed with ``Last-Event-ID`` (:meth:`_resuming`),
        so the caller sees every event exactly once. With ``idle_timeout``, stops once nothing arrived
        for that long (the replay of what exists, without waiting for what comes).
        """
        last = str(last_event_id) if last_event_id is not None else None
        ended = False

        def read(response: httpx.Response) -> Iterator[SseEvent]:
            nonlocal last, ended
            for event in iter_events(response):
                last, ended = event.id or last, _is_terminal(event)
                yield event
                if ended:
                    return

        # The server sends a keep-alive every 15 s: a minute of silence is a dead connection.
        read_timeout = STALL_TIMEOUT_S if idle_timeout is None else idle_timeout
        quiet: Quiet = "drop" if idle_timeout is None else "end"
        resume = lambda: {"headers": {"Last-Event-ID": last} if last is not None else {}}  # noqa: E731
        return self._resuming(job_id, "events", resume, read, lambda: ended, read_timeout, quiet)

    def _resuming(
        self,
        job_id: str,
        route: str,
        resume: Callable[[], dict[str, Any]],
        read: Callable[[httpx.Response], Iterator[Item]],
        ended: Callable[[], bool],
        read_timeout: float,
        quiet: Quiet,
    ) -> Iterator[Item]:
        """Items of the job's streaming ``route``, reconnecting until ``ended()`` says it is over.

        ``resume()`` gives each connection's request options: the resume point that ``read`` advances,
        so a reconnection repeats and loses nothing. After a drop (or a stream ended early) it waits
        0.25 s, doubling up to 5 s; ``retry_max_s`` without an item gives up with ConnectionFailed.
        ``quiet``: what ``read_timeout`` seconds of silence mean. Errors but 502/503/504 raise ApiError.
        """
        delay, down_since = 0.25, None
        while True:
            try:
                timeout = httpx.Timeout(10.0, read=read_timeout)
                with self._http.stream("GET", f"/v1/jobs/{job_id}/{route}", timeout=timeout, **resume()) as resp:
                    if resp.status_code >= 400 and resp.status_code not in (502, 503, 504):
                        resp.read()
                        raise ApiError.from_response(resp)
                    if resp.status_code < 400:
                        for item in read(resp):
                            delay, down_since = 0.25, None
                            yield item
                        if ended():
                            return
            except httpx.ReadTimeout:
                if quiet == "end":
                    return
                if quiet == "ask again":
                    delay, down_since = 0.25, None
                    continue
            except httpx.TransportError as exc:
                log.debug("%s stream of %s dropped: %s", route, job_id, exc)
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since > self.retry_max_s:
                raise ConnectionFailed(f"lost the {route.removesuffix('s')} stream of job {job_id} at {self.base_url}")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    # the run's own output (its stderr and stray stdout lines)
    def log_page(self, job_id: str, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        """One page of the run's log from byte ``offset``: ``text``, ``next_offset`` and ``complete``."""
        params: dict[str, Any] = {"offset": offset}
        if limit is not None:
            params["limit"] = limit
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{job_id}/logs", params=params)
        return result

    def log_text(self, job_id: str, offset: int = 0, limit: int | None = None) -> Iterator[str]:
        """The run's log as it is now, page after page from ``offset``, until ``complete`` or no more text."""
        while True:
            page = self.log_page(job_id, offset, limit)
            if page["text"]:
                yield page["text"]
            next_offset = int(page["next_offset"])
            if page["complete"] or next_offset == offset:
                return
            offset = next_offset

    def follow_log(self, job_id: str, offset: int = 0) -> Iterator[str]:
        """The run's log from ``offset`` as it is written, until the job has ended and all of it is sent.

        A dropped connection is resumed from the last byte received (the route's offsets are bytes),
        so nothing repeats; gives up with ConnectionFailed after ``retry_max_s`` without progress.
        """
        # One decoder across reconnections: a character cut by a drop is completed by the resumed bytes.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def read(response: httpx.Response) -> Iterator[str]:
            nonlocal offset
            for chunk in response.iter_bytes():
                offset += len(chunk)
                if text := decoder.decode(chunk):
                    yield text

        resume = lambda: {"params": {"offset": offset, "follow": "true"}}  # noqa: E731
        # The server ends the stream once the job has ended; a restarting API may end it sooner.
        ended = lambda: self.get(job_id)["status"] in TERMINAL  # noqa: E731
        # A quiet run (queued, or training without output) is not a dead service: ask again.
        yield from self._resuming(job_id, "logs", resume, read, ended, STALL_TIMEOUT_S, "ask again")
        if tail := decoder.decode(b"", final=True):
            yield tail

    # artifacts
    def artifacts(self, job_id: str) -> JsonList:
        data = self._json("GET", f"/v1/jobs/{job_id}/artifacts")
        items: JsonList = data.get("items", data) if isinstance(data, Mapping) else data
        return items

    def download(self, job_id: str, path: str, dest: str | Path, progress: Callable[[int], None] | None = None) -> Path:
        """Stream one artifact to ``dest``; returns the file written.

        ``dest`` is a folder (created when missing, the artifact keeps its file name) when it is one,
        ends with a separator, or does not exist and has no file suffix; otherwise it is the file's name.
        ``progress`` is called with the size of each chunk written.
        """
        target = Path(dest)
        as_folder = target.is_dir() or str(dest).endswith(("/", os.sep)) or (not target.exists() and not target.suffix)
        if as_folder:
            target = target / Path(path).name
        self._save(f"/v1/jobs/{job_id}/artifacts/{path}", target, progress)
        return target

    def _save(
        self, url: str, target: Path, progress: Callable[[int], None] | None, params: dict[str, Any] | None = None
    ) -> None:
        """Stream the body of ``GET url`` into the file ``target`` (its folder created)."""
        try:
            with self._http.stream("GET", url, params=params) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise ApiError.from_response(resp)
                target.parent.mkdir(parents=True, exist_ok=True)
                with target.open("wb") as out:
                    for chunk in resp.iter_bytes():
                        out.write(chunk)
                        if progress is not None:
                            progress(len(chunk))
        except httpx.TransportError as exc:
            raise ConnectionFailed(f"cannot reach {self.base_url}: {exc}") from exc

    def download_all(
        self, job_id: str, dest: str | Path, progress: Callable[[int], None] | None = None
    ) -> tuple[Path, ...]:
        """Every artifact of the job into folder ``dest`` (created when missing), keeping relative paths."""
        written: tuple[Path, ...] = ()
        for item in self.artifacts(job_id):
            rel = PurePosixPath(str(item["path"]))
            if rel.is_absolute() or ".." in rel.parts:  # the API never sends these; never write outside dest
                raise TrainjobsError(f"refusing artifact path {rel}")
            folder = Path(dest).joinpath(*rel.parts[:-1])
            folder.mkdir(parents=True, exist_ok=True)
            written += (self.download(job_id, str(rel), folder, progress),)
        return written

    # checkpoints
    def checkpoints(self, job_id: str) -> JsonObject:
        """The job's complete checkpoints (``items``, oldest first) and how the best one is chosen."""
        result: JsonObject = self._json("GET", f"/v1/jobs/{job_id}/checkpoints")
        return result

    def checkpoint_step(self, job_id: str, which: str | int) -> int:
        """The step of a checkpoint named by its step, ``best`` or ``last``; TrainjobsError when the job
        has none such."""
        if isinstance(which, int) or str(which).isdigit():
            return int(which)
        items = self.checkpoints(job_id)["items"]
        if which == "last" and items:
            return int(items[-1]["step"])
        if which == "best" and (best := [i for i in items if i["is_best"]]):
            return int(best[0]["step"])
        if which not in ("best", "last"):
            raise TrainjobsError(f"checkpoint: {which!r} is not a step, 'best' or 'last'")
        raise TrainjobsError(f"checkpoint: job {job_id} has no {which} checkpoint yet")

    def download_checkpoint(
        self, job_id: str, which: str | int, dest: str | Path, *, with_optimizer: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> Path:  # fmt: skip
        """Download a checkpoint (a step, ``best`` or ``last``) and unpack it into folder ``dest``
        (created); returns its folder, ``dest/checkpoint-<step>``, which ``from_pretrained`` loads."""
        step = self.checkpoint_step(job_id, which)
        folder = Path(dest)
        archive = folder / f".checkpoint-{step}.zip.part"
        params = {"with_optimizer": "true"} if with_optimizer else None
        try:
            self._save(f"/v1/jobs/{job_id}/checkpoints/{step}.zip", archive, progress, params)
            with zipfile.ZipFile(archive) as unpacked:
                unpacked.extractall(folder)  # extractall drops absolute paths and ".." parts
        finally:
            archive.unlink(missing_ok=True)
        return folder / f"checkpoint-{step}"

    # estimates, catalog, datasets
    def estimate(
        self,
        spec: str | Path | Mapping[str, Any] | BaseModel,
        gpu_memory_gb: float | None = None,
        devices: int | None = None,
        train_rows: int | None = None,
        eval_rows: int = 0,
        queue: str | None = None,
    ) -> dict[str, Any]:
        """The server's estimate for ``spec``: memory, with a budget the planner's fitting configs, and
        with ``train_rows`` the time and cost on ``queue`` (its finished jobs calibrate it)."""
        body: dict[str, Any] = {"spec": spec_payload(spec)}
        optional = {"gpu_memory_gb": gpu_memory_gb, "devices": devices, "train_rows": train_rows, "queue": queue}
        body.update({k: v for k, v in optional.items() if v is not None})
        if train_rows is not None:
            body["eval_rows"] = eval_rows
        result: dict[str, Any] = self._json("POST", "/v1/estimates", json=body)
        return result

    def catalog(self) -> Any:
        return self._json("GET", "/v1/models/catalog")

    def upload_dataset(
        self, path: str | Path, name: str | None = None, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Upload a CSV / JSON lines / Parquet file, or a folder (zipped here) of images or audio; retried
        safely like :meth:`submit`."""
        source = Path(path)
        if source.is_dir():
            filename, content = f"{source.name}.zip", zip_folder(source)
        else:
            filename, content = source.name, source.read_bytes()
        data = {"name": name} if name else None
        result: dict[str, Any] = self._create(
            "/v1/datasets", idempotency_key, files={"file": (filename, content)}, data=data, timeout=None
        )
        return result

    def datasets(self) -> JsonList:
        data = self._json("GET", "/v1/datasets")
        items: JsonList = data.get("items", data) if isinstance(data, Mapping) else data
        return items

    def usage(
        self, *, start: str | None = None, end: str | None = None, group_by: str = "day", owner: str | None = None
    ) -> JsonObject:
        """``GET /v1/usage``: device-hours, cost and final statuses of the jobs that finished in
        ``[start, end)`` (ISO 8601; default: this UTC month), grouped by ``owner``, ``queue`` or ``day``."""
        params = {"from": start, "to": end, "group_by": group_by, "owner": owner}
        result: JsonObject = self._json("GET", "/v1/usage", params={k: v for k, v in params.items() if v is not None})
        return result

    # webhooks
    def create_webhook(self, url: str, events: Sequence[str], description: str = "") -> JsonObject:
        """``POST /v1/webhooks``: the answer holds the signing secret (``whsec_...``), shown this once."""
        body = {"url": url, "events": list(events), "description": description}
        result: JsonObject = self._json("POST", "/v1/webhooks", json=body)
        return result

    def webhooks(self) -> JsonList:
        items: JsonList = self._json("GET", "/v1/webhooks")["items"]
        return items

    def delete_webhook(self, webhook_id: str) -> None:
        self._request("DELETE", f"/v1/webhooks/{webhook_id}")

    def rotate_webhook_secret(self, webhook_id: str) -> JsonObject:
        result: JsonObject = self._json("POST", f"/v1/webhooks/{webhook_id}/rotate-secret")
        return result

    def webhook_deliveries(self, webhook_id: str, limit: int = 50) -> JsonList:
        """The webhook's newest deliveries, newest first, each with its attempts."""
        items: JsonList = self._json("GET", f"/v1/webhooks/{webhook_id}/deliveries", params={"limit": limit})["items"]
        return items

    def redeliver(self, webhook_id: str, delivery_id: str) -> JsonObject:
        result: JsonObject = self._json("POST", f"/v1/webhooks/{webhook_id}/deliveries/{delivery_id}/redeliver")
        return result
