"""docker-compose.yml runs only commands this suite runs itself (tests/trainjobs/live.py), and has the
reliability settings the production shape needs."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.trainjobs.live import MIGRATE_ARGS, REPO, SERVE_ARGS, WORKER_ARGS


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    result: dict[str, Any] = compose["services"]
    return result


def option_names(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_each_built_service_runs_a_command_the_suite_runs(services: dict[str, Any]) -> None:
    built = {name: spec["command"] for name, spec in services.items() if "build" in spec}
    assert set(built) == {"migrate", "api", "worker"}
    assert built["migrate"] == ["alembic", *MIGRATE_ARGS]
    assert built["worker"] == ["trainjobs", *WORKER_ARGS]
    # The API's address differs (0.0.0.0:8000 in a container): same subcommand and options.
    assert built["api"][:2] == ["trainjobs", SERVE_ARGS[0]]
    assert option_names(built["api"]) == option_names(SERVE_ARGS)


def test_api_and_worker_wait_for_migrations_and_redis(services: dict[str, Any]) -> None:
    for name in ("api", "worker"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("postgres", "redis", "api", "worker"):
        assert services[name]["healthcheck"]["test"], name


def test_worker_reserves_a_gpu_and_redis_never_drops_messages(services: dict[str, Any]) -> None:
    (device,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    assert redis_command[redis_command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    env = services["api"]["environment"]
    assert env["TRAINJOBS_ENV"] == "production"
    assert env["BROKER_URL"].startswith("redis://") and env["DATABASE_URL"].startswith("postgresql")
