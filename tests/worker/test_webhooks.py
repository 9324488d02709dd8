"""Webhook deliveries, from the outbox rows the job store writes to a real HTTP receiver on 127.0.0.1.

The receiver checks every signature with the README's own verification code (executed from the
README's "Webhooks" section). Status moves and checkpoints go through the job-store functions the
worker and the API use (service_core/db/jobstore.py); the sender is worker/webhook_sender.py, with
the backoff scaled down by its setting (TRAINJOBS_WEBHOOK_BACKOFF_SECONDS) so retries take seconds.
A real job through a live API and worker is in tests/trainjobs/test_webhooks_live.py.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from service_core.db.base import utcnow
from service_core.db.jobstore import add_events, insert_job, transition
from service_core.db.models import Webhook, WebhookDelivery
from service_core.db.session import get_engine, session_scope
from service_core.settings import Settings, get_settings
from service_core.status import ErrorReason, JobStatus
from service_core.webhooks import EVENT_TYPES, new_secret
from tests.trainjobs.live import REPO
from tests.worker.live import free_port
from worker.webhook_sender import WebhookSender


def readme_verify() -> Callable[..., bool]:
    """The ``verify`` function of the README's Webhooks section, as a user would copy it."""
    section = (REPO / "README.md").read_text().split("### Webhooks", 1)[1].split("\n## ", 1)[0]
    code = next(block for block in re.findall(r"```python\n(.*?)```", section, re.S) if "def verify" in block)
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # the documented snippet itself
    verify: Callable[..., bool] = namespace["verify"]
    return verify


VERIFY = readme_verify()


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that records each delivery, verified with the README's code.

    ``answer`` is the status it replies with; ``stop``/``start`` take it off the port and back (a
    receiver that is down refuses connections).
    """

    def __init__(self, port: int | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.port = port or free_port()
        self.tls = tls
        self.secret = ""
        self.answer = 200
        self.seen: list[dict[str, Any]] = []
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.seen.append({
                    "id": self.headers["webhook-id"], "host": self.headers["Host"], "body": json.loads(body),
                    "verified": VERIFY(receiver.secret, self.headers, body),
                })  # fmt: skip
                self.send_response(receiver.answer)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def types(self) -> list[str]:
        return [item["body"]["type"] for item in self.seen]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    live = Receiver().start()
    yield live
    live.stop()


def fast(settings: Settings, **more: Any) -> Settings:
    """The settings with private targets allowed (the receiver is on loopback) and a short backoff."""
    values = {"allow_private_targets": True, "webhook_backoff_seconds": 0.2, "webhook_poll_seconds": 0.05, **more}
    return settings.model_copy(update=values)


def add_webhook(settings: Settings, url: str, owner: str = "alice", events: tuple[str, ...] = EVENT_TYPES) -> Webhook:
    with session_scope(settings.database_url) as session:
        hook = Webhook(owner=owner, url=url, events=list(events), description="", secret=new_secret(), enabled=True)
        session.add(hook)
        session.flush()
        session.expunge(hook)
        return hook


def submit(settings: Settings, owner: str = "alice", name: str = "job") -> str:
    """A job stored the way the API's submit stores one without an Idempotency-Key (autocommit)."""
    with get_engine(settings.database_url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        return insert_job(conn, owner=owner, name=name, spec={}, created_at=utcnow()).id


def move(settings: Settings, job_id: str, new: JobStatus, **kwargs: Any) -> None:
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, new, **kwargs)


def deliveries(settings: Settings, **where: Any) -> list[WebhookDelivery]:
    with session_scope(settings.database_url) as session:
        query = select(WebhookDelivery).filter_by(**where).order_by(WebhookDelivery.seq, WebhookDelivery.created_at)
        rows = list(session.execute(query).scalars())
        session.expunge_all()
        return rows


def drain(sender: WebhookSender, settings: Settings, timeout: float = 30.0) -> None:
    """Run passes until no delivery is pending."""
    deadline = time.monotonic() + timeout
    while any(d.state == "pending" for d in deliveries(settings)):
        assert time.monotonic() < deadline, [(d.event_type, d.state, d.attempt_log) for d in deliveries(settings)]
        if not sender.run_once():
            time.sleep(0.05)


# The webhook events of full_life's job, in order.
LIFE = ["job.queued", "job.running", "checkpoint.created", "job.queued", "job.running", "job.paused", "job.queued",
        "job.running", "job.succeeded"]  # fmt: skip


def full_life(settings: Settings) -> str:
    """Queued, running, a checkpoint, requeued, running again, paused and resumed, succeeded with final
    metrics."""
    job_id = submit(settings, name="full-life")
    move(settings, job_id, JobStatus.running)
    with session_scope(settings.database_url) as session:
        add_events(session, job_id, [("checkpoint", {"step": 4, "epoch": 0.5, "loss": 0.7}, None)])
    move(settings, job_id, JobStatus.queued, reason=ErrorReason.shutdown_requeue, message="slot stopped")
    move(settings, job_id, JobStatus.running)
    move(settings, job_id, JobStatus.paused, reason=ErrorReason.paused, message="paused by alice")
    move(settings, job_id, JobStatus.queued)
    move(settings, job_id, JobStatus.running)
    move(settings, job_id, JobStatus.succeeded, final_metrics={"eval_loss": 0.25})
    return job_id


@pytest.fixture
def public_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """TRAINJOBS_PUBLIC_URL in this process's settings (the job store reads it where events happen)."""
    monkeypatch.setenv("TRAINJOBS_PUBLIC_URL", "https://trainjobs.example.com/")
    get_settings.cache_clear()
    yield "https://trainjobs.example.com"
    monkeypatch.delenv("TRAINJOBS_PUBLIC_URL")
    get_settings.cache_clear()


def test_each_event_reaches_the_receiver_once_signed_and_in_order(
    db_settings: Settings, receiver: Receiver, public_url: str
) -> None:
    settings = fast(db_settings)
    receiver.secret = add_webhook(settings, receiver.url).secret
    other = add_webhook(settings, receiver.url, owner="bob")  # another owner's: sees none of alice's events
    job_id = full_life(settings)
    failed, cancelled = submit(settings, name="fails"), submit(settings, name="cancelled")
    move(settings, failed, JobStatus.running)
    move(settings, failed, JobStatus.failed, reason=ErrorReason.data_error, message="no column 'text'")
    move(settings, cancelled, JobStatus.cancelled, reason=ErrorReason.cancelled, message="cancelled by alice")
    drain(WebhookSender(settings, "sender"), settings)

    assert all(item["verified"] for item in receiver.seen)
    assert not deliveries(settings, webhook_id=other.id)
    by_job: dict[str, list[str]] = {}
    for item in receiver.seen:
        by_job.setdefault(item["body"]["data"]["job_id"], []).append(item["body"]["type"])
    assert by_job[job_id] == LIFE
    assert by_job[failed] == ["job.queued", "job.running", "job.failed"]
    assert by_job[cancelled] == ["job.queued", "job.cancelled"]
    assert set(receiver.types()) == set(EVENT_TYPES)
    assert len({item["id"] for item in receiver.seen}) == len(receiver.seen)  # one delivery per change
    bodies = {(item["body"]["data"]["job_id"], item["body"]["type"]): item["body"] for item in receiver.seen}
    done = bodies[job_id, "job.succeeded"]["data"]
    assert done["final_metrics"] == {"eval_loss": 0.25} and done["status"] == "succeeded"
    assert done["dashboard_url"] == f"{public_url}/dashboard#/jobs/{job_id}"
    assert bodies[job_id, "checkpoint.created"]["data"]["checkpoint"] == {"step": 4, "epoch": 0.5, "loss": 0.7}
    requeued = [item["body"]["data"] for item in receiver.seen if item["body"]["type"] == "job.queued"]
    assert [data["reason"] for data in requeued if data["job_id"] == job_id] == [None, "shutdown_requeue", None]
    assert bodies[job_id, "job.paused"]["data"]["reason"] == "paused"
    assert bodies[failed, "job.failed"]["data"]["reason"] == "data_error"
    assert bodies[failed, "job.failed"]["data"]["message"] == "no column 'text'"
    assert all(settings.secret_key not in json.dumps(item["body"]) for item in receiver.seen)
    assert all(d.state == "delivered" and d.attempts == 1 for d in deliveries(settings))


def test_only_subscribed_events_are_written(sqlite_settings: Settings, receiver: Receiver) -> None:
    settings = fast(sqlite_settings)
    hook = add_webhook(settings, receiver.url, events=("job.succeeded", "job.failed"))
    full_life(settings)
    assert [d.event_type for d in deliveries(settings, webhook_id=hook.id)] == ["job.succeeded"]


def test_a_receiver_down_for_a_while_gets_every_delivery_in_order(sqlite_settings: Settings) -> None:
    # The 30 s outage scaled down to 3 s, with a 0.2 s backoff base (TRAINJOBS_WEBHOOK_BACKOFF_SECONDS).
    settings = fast(sqlite_settings)
    receiver = Receiver()  # not started: connections are refused
    receiver.secret = add_webhook(settings, receiver.url).secret
    sender = WebhookSender(settings, "sender").start()
    try:
        jobs = [full_life(settings) for _ in range(2)]
        time.sleep(3.0)
        waiting = deliveries(settings)
        assert all(d.state == "pending" for d in waiting)
        assert max(d.attempts for d in waiting) >= 2
        assert all(entry["error"] and entry["status_code"] is None for d in waiting for entry in d.attempt_log)
        receiver.start()
        deadline = time.monotonic() + 60
        while any(d.state == "pending" for d in deliveries(settings)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        sender.stop()
        receiver.stop()
    assert all(item["verified"] for item in receiver.seen)
    for job_id in jobs:
        types = [item["body"]["type"] for item in receiver.seen if item["body"]["data"]["job_id"] == job_id]
        assert types == LIFE
    assert len(receiver.seen) == len(deliveries(settings)) == 2 * len(LIFE)  # each once, none lost


def test_a_later_event_waits_for_an_earlier_pending_one(sqlite_settings: Settings, receiver: Receiver) -> None:
    settings = fast(sqlite_settings)
    add_webhook(settings, receiver.url)
    job_id = submit(settings)
    move(settings, job_id, JobStatus.running)
    queued, _running = deliveries(settings, job_id=job_id)
    sender = WebhookSender(settings, "sender")
    assert sender.due() == [queued.id]
    assert sender.claim(queued.id)
    assert sender.due() == []  # the earlier one is held by a sender: the later one still waits


def test_a_fresh_sender_takes_over_a_claim_left_by_a_dead_one(db_settings: Settings, receiver: Receiver) -> None:
    settings = fast(db_settings)
    receiver.secret = add_webhook(settings, receiver.url).secret
    job_id = submit(settings)
    (queued,) = deliveries(settings)
    dead = WebhookSender(settings, "dead-worker")
    assert dead.claim(queued.id)  # claimed, then the process died before sending
    fresh = WebhookSender(settings, "fresh-worker")
    assert fresh.run_once() == 0  # the claim still holds
    with session_scope(settings.database_url) as session:  # ... until its lease runs out
        session.execute(update(WebhookDelivery).values(claimed_until=utcnow() - timedelta(seconds=1)))
    drain(fresh, settings)
    assert [item["body"]["data"]["job_id"] for item in receiver.seen] == [job_id]
    assert receiver.seen[0]["verified"]


def test_two_senders_racing_deliver_each_delivery_once(db_settings: Settings, receiver: Receiver) -> None:
    settings = fast(db_settings)
    receiver.secret = add_webhook(settings, receiver.url).secret
    for _ in range(15):
        move(settings, submit(settings), JobStatus.running)
    senders = [WebhookSender(settings, f"sender-{i}") for i in range(2)]
    threads = [threading.Thread(target=drain, args=(sender, settings)) for sender in senders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = [item["id"] for item in receiver.seen]
    assert len(ids) == len(set(ids)) == 30
    assert {d.state for d in deliveries(settings)} == {"delivered"}


def test_410_gone_disables_the_webhook_and_its_pending_deliveries(
    sqlite_settings: Settings, receiver: Receiver
) -> None:
    settings = fast(sqlite_settings)
    hook = add_webhook(settings, receiver.url)
    receiver.answer = 410
    job_id = submit(settings)
    move(settings, job_id, JobStatus.running)
    WebhookSender(settings, "sender").run_once()
    assert len(receiver.seen) == 1  # the second waited for the first, and is never sent
    with session_scope(settings.database_url) as session:
        stored = session.get(Webhook, hook.id)
        assert stored is not None and not stored.enabled and "410" in (stored.disabled_reason or "")
    assert [(d.state, d.attempts) for d in deliveries(settings)] == [("disabled", 1), ("disabled", 0)]
    move(settings, job_id, JobStatus.succeeded)
    assert len(deliveries(settings)) == 2  # a disabled webhook gets no new deliveries


def test_other_answers_are_retried_until_the_day_is_over(sqlite_settings: Settings, receiver: Receiver) -> None:
    settings = fast(sqlite_settings)
    add_webhook(settings, receiver.url)
    receiver.answer = 503
    submit(settings)
    sender = WebhookSender(settings, "sender")
    sender.run_once()
    (first,) = deliveries(settings)
    assert first.state == "pending" and first.attempts == 1 and first.attempt_log[0]["status_code"] == 503
    with session_scope(settings.database_url) as session:  # the event is a day old now
        session.execute(update(WebhookDelivery).values(created_at=utcnow() - timedelta(hours=24, seconds=1),
                                                       next_attempt_at=utcnow()))  # fmt: skip
    sender.run_once()
    (last,) = deliveries(settings)
    assert last.state == "failed" and last.attempts == 2


def test_a_rebinding_answer_is_refused_at_delivery(sqlite_settings: Settings, receiver: Receiver) -> None:
    # The name passed when the webhook was created (it resolved to nothing, or to a public address
    # then); when the sender resolves it, it answers loopback, where the receiver listens.
    settings = sqlite_settings.model_copy(update={"webhook_backoff_seconds": 0.2})
    add_webhook(settings, f"http://hooks.example.test:{receiver.port}/hooks")
    submit(settings)

    def rebinding(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        assert host == "hooks.example.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))]

    WebhookSender(settings, "sender", resolve=rebinding).run_once()
    (delivery,) = deliveries(settings)
    assert receiver.seen == []
    assert delivery.state == "pending" and delivery.attempts == 1
    assert "non-public address 127.0.0.1" in delivery.attempt_log[0]["error"]
    assert delivery.attempt_log[0]["status_code"] is None


def test_the_sender_connects_to_the_address_it_checked(sqlite_settings: Settings, receiver: Receiver) -> None:
    # With private targets allowed, the one answer the sender got is where it connects, under the name.
    settings = fast(sqlite_settings)
    receiver.secret = add_webhook(settings, f"http://hooks.example.test:{receiver.port}/hooks").secret
    submit(settings)
    answers = iter([[(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", receiver.port))]])
    WebhookSender(settings, "sender", resolve=lambda *a, **k: next(answers)).run_once()
    assert [(item["host"], item["verified"]) for item in receiver.seen] == [
        (f"hooks.example.test:{receiver.port}", True)
    ]


def test_https_goes_to_the_checked_address_under_the_name(sqlite_settings: Settings, tmp_path: Path) -> None:
    # TLS to the pinned address: the certificate is checked against the URL's name (sent as SNI), not
    # against the address connected to.
    name = "hooks.example.test"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"],
                   check=True, capture_output=True)  # fmt: skip
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    receiver = Receiver(tls=server_tls).start()
    try:
        settings = fast(sqlite_settings)
        receiver.secret = add_webhook(settings, f"https://{name}:{receiver.port}/hooks").secret
        submit(settings)
        loopback = [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", receiver.port))]
        sender = WebhookSender(settings, "sender", resolve=lambda *a, **k: loopback)
        sender.client = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), trust_env=False)
        sender.run_once()
    finally:
        receiver.stop()
    (delivery,) = deliveries(settings)
    assert delivery.state == "delivered", delivery.attempt_log
    assert [(item["host"], item["verified"]) for item in receiver.seen] == [(f"{name}:{receiver.port}", True)]
