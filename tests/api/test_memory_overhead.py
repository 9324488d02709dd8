"""One overhead setting, one unit: ``trainjobs estimate`` and the API add the same overhead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from trainer_core.memory_overhead import OVERHEAD_ENV
from trainjobs.cli import main

OVERHEAD_MB = 300


@pytest.fixture
def settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The API's settings with the overhead read from the environment, as a deployed service reads it."""
    monkeypatch.setenv(OVERHEAD_ENV, str(OVERHEAD_MB))
    return settings.model_copy(update={"memory_overhead_mb": Settings().memory_overhead_mb})


def test_local_and_api_estimates_add_the_same_overhead(
    client: TestClient, keys: Keys, settings: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert settings.memory_overhead_mb == OVERHEAD_MB
    spec = make_spec()
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    assert main(["estimate", str(spec_file), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    response = client.post("/v1/estimates/memory", json={"spec": spec}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    remote = response.json()["estimate"]
    assert local["overhead_bytes"] == remote["overhead_bytes"] == OVERHEAD_MB * 1024**2
    assert local["total_bytes"] == remote["total_bytes"]
