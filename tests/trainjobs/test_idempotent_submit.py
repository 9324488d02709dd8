"""A submit whose answer is lost creates one job, not two (issue 31): the API process is killed right
after its INSERT commits (the testing aid ``TRAINJOBS_FAULT_API_EXIT_AFTER_INSERT``, api/idempotency.py),
so the client sees the connection drop although the job is stored. The CLI and the Python client send
one ``Idempotency-Key`` per logical submit and retry on connection errors; once the API is back (here:
restarted without the aid), the retry gets the first answer. Real API processes (``trainjobs serve``)
on SQLite: what a key does on each database (one job under concurrent retries, the first answer
replayed, uploads alike) is tested on SQLite and PostgreSQL in tests/api/test_idempotency.py; what
this adds is the process dying between its commit and its answer, and the clients' retries."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.idempotency import FAULT_EXIT_ENV, FAULT_EXIT_STATUS
from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService
from trainjobs.client import Client, ConnectionFailed


@pytest.fixture
def service(tmp_path: Path) -> Iterator[LiveService]:
    """Migrations and a database, no API yet (each test starts it with the fault aid) and no worker."""
    live = LiveService(tmp_path / "home")
    live.data_root.mkdir(parents=True)
    live.migrate()
    try:
        yield live
    finally:
        live.stop()


def die_after_the_insert_then_come_back(live: LiveService) -> None:
    """The API exits once a submit committed (before answering); start it again without the aid."""
    assert live.api is not None
    assert live.api.wait(timeout=180) == FAULT_EXIT_STATUS, (live.logs / "api.log").read_text()[-2000:]
    del live.env[FAULT_EXIT_ENV]
    live.start_api()


def test_the_cli_retries_a_submit_whose_answer_was_lost_and_one_job_exists(service: LiveService) -> None:
    files = write_sentiment_csv(service.data_root / "sentiment", n_train=16, n_val=8)
    spec_file = service.home / "job.json"
    spec_file.write_text(json.dumps(job_spec(files, "lost-answer")))
    service.env[FAULT_EXIT_ENV] = "1"
    service.start_api()
    cli = service.cli_popen("submit", str(spec_file))
    die_after_the_insert_then_come_back(service)
    _, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err
    submitted = re.search(r"submitted lost-answer as (\w+)", err)
    assert submitted is not None, err
    with service.client() as client:
        jobs = list(client.list())
    assert [job["id"] for job in jobs] == [submitted.group(1)]  # the first try's job, and no second


def test_the_client_retries_an_upload_whose_answer_was_lost_and_one_dataset_exists(service: LiveService) -> None:
    csv = service.home / "reviews.csv"
    csv.write_text("text,label\ngreat film,1\nawful film,0\n")
    service.env[FAULT_EXIT_ENV] = "1"
    service.start_api()
    result: dict[str, Any] = {}

    def upload() -> None:
        with service.client() as client:
            result["dataset"] = client.upload_dataset(csv, name="reviews")

    thread = threading.Thread(target=upload)
    thread.start()
    die_after_the_insert_then_come_back(service)
    thread.join(timeout=300)
    with service.client() as client:
        stored = client.datasets()
    assert [d["id"] for d in stored] == [result["dataset"]["id"]]
    assert len(list((service.data_root / "uploads").rglob("reviews.csv"))) == 1  # one stored copy


def test_a_service_not_there_at_all_is_reported_after_one_try(tmp_path: Path) -> None:
    """Nothing listens on the port: the first try cannot connect, so nothing was sent, and the client
    says so at once instead of trying again for ``retry_max_s`` (a wrong URL is the user's to fix)."""
    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = job_spec(write_sentiment_csv(tmp_path / "sentiment", n_train=4, n_val=2), "nowhere")
    sent: list[httpx.Request] = []
    with Client(f"http://127.0.0.1:{port}", "key", retry_max_s=3) as client:
        client._http.event_hooks["request"].append(sent.append)
        with pytest.raises(ConnectionFailed, match=f"cannot reach http://127.0.0.1:{port}"):
            client.submit(spec)
    assert len(sent) == 1, f"{len(sent)} tries at a service that is not there"
