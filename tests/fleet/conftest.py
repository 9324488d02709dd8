"""The fleet fixtures: one network of hosts for the package (its tests run as one unit on one xdist
worker, and the hosts end with them), workers started per test on its own queue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from service_core.db.models import Job
from service_core.db.session import session_scope
from service_core.runs import RUN_LOG_NAME
from tests.conftest import CALL_FAILED
from tests.trainer_core.datagen import write_sentiment_csv

from .netns import netns_unavailable
from .stack import Fleet, fleet, new_queue, upload_csv


@pytest.fixture(scope="package")
def fleet_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """An API host and two worker hosts in network namespaces, on PostgreSQL, Redis and SeaweedFS."""
    if why := netns_unavailable():
        pytest.skip(f"no network namespaces: {why}")
    with fleet(tmp_path_factory.mktemp("fleet")) as running:
        yield running


@pytest.fixture
def queue(fleet_stack: Fleet, request: pytest.FixtureRequest) -> Iterator[str]:
    """A queue of this test's own; every worker host is wiped (processes, disk) after the test."""
    name = new_queue()
    yield name
    if request.node.stash.get(CALL_FAILED, False):
        print_diagnosis(fleet_stack, name)
    fleet_stack.stop_workers(name)


def print_diagnosis(fleet: Fleet, queue: str) -> None:
    """What a failed fleet test leaves for its reader (pytest shows it under "Captured stdout
    teardown"): each job's status events and the tails of the hosts' logs. The hosts' disks are wiped
    after the test, and a CI run keeps nothing else."""
    with session_scope(fleet.database_url) as session:
        jobs = session.execute(select(Job.id).where(Job.queue == queue).order_by(Job.created_at)).scalars().all()
    for job_id in jobs:
        print(f"--- job {job_id}: status events")
        for data in fleet.statuses(job_id):
            print(f"    {data}")
    hosts = [log for log in sorted((fleet.root / "logs").glob("*.log")) if queue in log.name or "-api." in log.name]
    runs = [log for job_id in jobs for log in sorted(fleet.root.glob(f"disks/*/home/runs/{job_id}/{RUN_LOG_NAME}"))]
    for log in hosts + runs:
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log.relative_to(fleet.root)}: last {min(len(lines), 80)} of {len(lines)} lines")
        print("\n".join(line[:400] for line in lines[-80:]))


@pytest.fixture(scope="package")
def sentiment_dataset(fleet_stack: Fleet, tmp_path_factory: pytest.TempPathFactory) -> str:
    """64 reviews uploaded once through the API host (8 steps an epoch); returns the dataset id."""
    files = write_sentiment_csv(tmp_path_factory.mktemp("fleet-data"), n_train=64, n_val=8)
    with fleet_stack.client() as client:
        return str(upload_csv(client, Path(files["train"]))["id"])
