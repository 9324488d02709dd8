"""Fixtures for client and CLI tests: one live service for the session, and job specs on its data.

The service is shared by every module that asks for it (tests/conftest.py keeps those modules on one
xdist worker): tests that restart its API leave it running, and each test reads only its own jobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.trainjobs.live import LiveService


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    live = LiveService(tmp_path_factory.mktemp("service")).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="session")
def sentiment_files(service: LiveService) -> dict[str, str]:
    """A small sentiment CSV pair under the service's data root (the only place jobs may read)."""
    return write_sentiment_csv(service.data_root / "sentiment", n_train=96, n_val=32)


def job_spec(files: dict[str, str], name: str, **overrides: Any) -> dict[str, Any]:
    """A tiny config-built BERT job on ``files``; a few seconds of training."""
    base: dict[str, Any] = {"name": name, "training": {"num_train_epochs": 2, "logging_steps": 2}}
    spec = tiny_text_spec(files, **base)
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def write_json(path: Path, data: Any) -> Path:
    import json

    path.write_text(json.dumps(data))
    return path
