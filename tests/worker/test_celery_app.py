"""The one Celery configuration: reliability settings, priorities on Redis, the embedded broker."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from kombu import Connection

from service_core import redis_transport
from service_core.queue import REDIS_TRANSPORT, TASK_NAME, celery_config, celery_for, enqueue_job
from service_core.settings import Settings

from .conftest import make_settings

REDIS_URL = "redis://127.0.0.1:6379/13"


def drain(settings: Settings, queue: str) -> list[tuple[str, str]]:
    """(task name, job id) of every message on ``queue``, in delivery order."""
    out: list[tuple[str, str]] = []
    with celery_for(settings).connection_for_read() as conn, conn.SimpleQueue(queue) as q:
        while True:
            try:
                message = q.get(timeout=1)
            except q.Empty:
                return out
            out.append((message.headers["task"], message.payload[0][0]))
            message.ack()


def test_reliability_settings_are_spelled_out(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, BROKER_URL=REDIS_URL, TRAINJOBS_MAX_JOB_HOURS="10")
    conf = celery_for(settings).conf
    assert conf.task_serializer == "json" and conf.accept_content == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1 and conf.task_ignore_result
    # Redis must never hand a still-running job to another worker: longer than the longest job.
    assert conf.broker_transport_options["visibility_timeout"] > 10 * 3600


def test_redis_delivers_higher_priority_first(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, BROKER_URL=REDIS_URL)
    queue = f"prio-{uuid.uuid4().hex[:8]}"
    try:
        for job_id, priority in (("low", 0), ("high", 9), ("mid", 5), ("low2", 0)):
            enqueue_job(job_id, queue, priority, settings)
        assert drain(settings, queue) == [(TASK_NAME, "high"), (TASK_NAME, "mid"), (TASK_NAME, "low"),
                                          (TASK_NAME, "low2")]  # fmt: skip
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"*{queue}*"):
            client.delete(key)


def test_redis_publishing_reuses_one_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # kombu builds a redis.Redis per published message; service_core.redis_transport keeps one per channel.
    settings = make_settings(tmp_path, BROKER_URL=REDIS_URL)
    assert celery_for(settings).conf.broker_transport == REDIS_TRANSPORT
    built: list[object] = []
    real_create = redis_transport.Channel._create_client

    def counting_create(self: redis_transport.Channel, asynchronous: bool = False) -> object:
        client = real_create(self, asynchronous)
        if not asynchronous:
            built.append(client)
        return client

    monkeypatch.setattr(redis_transport.Channel, "_create_client", counting_create)
    queue = f"reuse-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(5):
            enqueue_job(f"job{i}", queue, 0, settings)
        assert drain(settings, queue) == [(TASK_NAME, f"job{i}") for i in range(5)]
        # One publishing client for the producer's channel (and at most one for the reading one).
        assert 1 <= len(built) <= 2
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"*{queue}*"):
            client.delete(key)


def test_only_plain_redis_urls_get_the_custom_transport(tmp_path: Path) -> None:
    assert celery_config(make_settings(tmp_path))["broker_transport"] is None  # embedded broker
    assert celery_config(make_settings(tmp_path, BROKER_URL="rediss://h:6380/0"))["broker_transport"] == REDIS_TRANSPORT


def test_embedded_broker_keeps_jobs_in_submission_order(tmp_path: Path) -> None:
    # kombu's SQLAlchemy transport has no priorities (documented): first in, first out.
    settings = make_settings(tmp_path)
    assert settings.broker_url.startswith("sqla+sqlite:///")
    queue = "embedded"
    for job_id, priority in (("a", 0), ("b", 9), ("c", 5)):
        enqueue_job(job_id, queue, priority, settings)
    # A separate connection (another process would see the same): the messages are in the file.
    with Connection(settings.broker_url) as conn, conn.SimpleQueue(queue) as q:
        first = q.get(timeout=5)
        assert first.payload[0] == ["a"]
        first.ack()
    assert drain(settings, queue) == [(TASK_NAME, "b"), (TASK_NAME, "c")]


def test_enqueueing_does_not_load_torch() -> None:
    code = "import sys, service_core.queue; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_embedded_broker_consumers_poll_every_tenth_of_a_second(tmp_path: Path) -> None:
    # kombu's 1 s default put 0.5 s on average between a submit and its pickup.
    from worker.celery_app import EMBEDDED_POLL_S

    settings = make_settings(tmp_path)
    with celery_for(settings).connection_for_read() as conn:
        assert conn.transport.polling_interval == EMBEDDED_POLL_S == 0.1


def test_an_idle_consumer_polls_the_embedded_broker_without_its_write_lock(tmp_path: Path) -> None:
    """An idle slot polls ten times a second: kombu's take alone opens a write transaction each time,
    which waits behind (and holds up) every submit's. The slots' channel looks first, without a lock."""
    from worker.celery_app import EmbeddedChannel

    settings = make_settings(tmp_path)
    queue = "idle"
    enqueue_job("a", queue, 0, settings)
    assert drain(settings, queue) == [(TASK_NAME, "a")]  # the file, its tables and the queue exist
    writer = sqlite3.connect(settings.broker_url.removeprefix("sqla+sqlite:///"), isolation_level=None)
    with celery_for(settings).connection_for_read() as conn, conn.SimpleQueue(queue) as q:
        assert isinstance(conn.default_channel, EmbeddedChannel)
        writer.execute("BEGIN IMMEDIATE")  # a submit in progress holds the write lock
        started = time.monotonic()
        with pytest.raises(q.Empty):
            q.get(timeout=1)  # kombu's own take waits the connection's 30 s timeout here, then fails
        assert time.monotonic() - started < 5
        writer.execute("ROLLBACK")
        enqueue_job("b", queue, 0, settings)
        message = q.get(timeout=5)  # a visible message: kombu's locked take runs and hands it over
        assert message.payload[0] == ["b"]
        message.ack()
    writer.close()
    assert drain(settings, queue) == []
