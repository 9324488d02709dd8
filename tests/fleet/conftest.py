"""The fleet fixtures: one network of hosts for the package (its tests run as one unit on one xdist
worker, and the hosts end with them), workers started per test on its own queue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
def queue(fleet_stack: Fleet) -> Iterator[str]:
    """A queue of this test's own; every worker host is wiped (processes, disk) after the test."""
    name = new_queue()
    yield name
    fleet_stack.stop_workers(name)


@pytest.fixture(scope="package")
def sentiment_dataset(fleet_stack: Fleet, tmp_path_factory: pytest.TempPathFactory) -> str:
    """64 reviews uploaded once through the API host (8 steps an epoch); returns the dataset id."""
    files = write_sentiment_csv(tmp_path_factory.mktemp("fleet-data"), n_train=64, n_val=8)
    with fleet_stack.client() as client:
        return str(upload_csv(client, Path(files["train"]))["id"])
