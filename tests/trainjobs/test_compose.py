"""docker-compose.yml runs only commands this suite runs itself (tests/trainjobs/live.py), has the
reliability settings the production shape needs, points the API and the workers at its object store, and
is a file `docker compose config` accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any
from urllib.parse import urlparse

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
    assert built["migrate"] == ["trainjobs", *MIGRATE_ARGS]
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


def test_api_and_workers_keep_artifacts_and_data_in_the_seaweedfs_service(services: dict[str, Any]) -> None:
    store = services["seaweedfs"]
    assert store["image"].startswith("chrislusf/seaweedfs:") and store["command"][0] == "mini"
    (bucket,) = [a.split("=", 1)[1] for a in store["command"] if a.startswith("-bucket=")]
    assert store["healthcheck"]["test"] and any(v.endswith(":/data") for v in store["volumes"])
    for name in ("api", "worker"):
        env = services[name]["environment"]
        assert env["ARTIFACTS_ROOT"].startswith(f"s3://{bucket}/") and env["DATA_ROOT"].startswith(f"s3://{bucket}/")
        endpoint = urlparse(env["AWS_ENDPOINT_URL"])
        assert endpoint.hostname == "seaweedfs" and endpoint.port == 8333  # weed's S3 port, unchanged
        # SeaweedFS takes its admin identity from the same two variables it hands to the service.
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key] == store["environment"][key] and env[key].startswith("${")
        assert env["AWS_DEFAULT_REGION"]
        assert services[name]["depends_on"]["seaweedfs"]["condition"] == "service_healthy"


def test_docker_compose_config_accepts_the_file() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI on this machine")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI here has no compose plugin (`docker compose version` fails)")
    env = {**os.environ, "TRAINJOBS_SECRET_KEY": "x" * 32, "TRAINJOBS_API_KEY": "tj_" + "k" * 32,
           "TRAINJOBS_S3_ACCESS_KEY": "access", "TRAINJOBS_S3_SECRET_KEY": "s" * 32}  # fmt: skip
    checked = subprocess.run(["docker", "compose", "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                             env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stderr
