"""A database that goes away is a 503 problem with Retry-After on every route (not a 500), and the API
recovers by itself when it comes back, with nothing stored lost (issue 12, "Database blips").

The database is real PostgreSQL behind a TCP proxy the test cuts: the server stays up for everyone
else, while this API sees refused and reset connections."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from api.main import create_app
from bench.chaos_proxy import TcpProxy
from service_core.db.base import Base
from service_core.keys import create_api_key
from service_core.settings import Settings
from tests.api.conftest import PG_SERVER, make_spec
from tests.trainer_core.datagen import write_sentiment_csv

pytestmark = pytest.mark.postgres


@pytest.fixture
def proxied_pg() -> Iterator[tuple[TcpProxy, str]]:
    name = f"trainjobs_outage_{secrets.token_hex(5)}"
    server = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    direct = create_engine(f"{PG_SERVER}/{name}")
    Base.metadata.create_all(direct)
    direct.dispose()
    try:
        with TcpProxy(("127.0.0.1", 5432)) as proxy:
            yield proxy, f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{name}"
    finally:
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        server.dispose()


def test_every_route_answers_503_while_the_database_is_away_and_recovers(
    proxied_pg: tuple[TcpProxy, str], tmp_path: Path
) -> None:
    proxy, url = proxied_pg
    write_sentiment_csv(tmp_path / "data" / "reviews", n_train=32, n_val=8)  # what make_spec() trains on
    settings = Settings.model_validate({
        "TRAINJOBS_HOME": tmp_path, "DATABASE_URL": url, "DATA_ROOT": tmp_path / "data",
        "BROKER_URL": f"sqla+sqlite:///{tmp_path / 'broker.db'}", "ARTIFACTS_ROOT": str(tmp_path / "artifacts"),
        "TRAINJOBS_AUTH_CACHE_SECONDS": 0,  # every request asks the database, as after the cache expires
    })  # fmt: skip
    app = create_app(settings)
    with app.state.sessionmaker() as db:
        key = create_api_key(db, "alice", settings=settings)
        db.commit()
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(app, raise_server_exceptions=False) as client:
        created = client.post("/v1/jobs", json=make_spec(), headers=auth)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]

        proxy.cut()
        away = {
            "list": client.get("/v1/jobs", headers=auth),
            "detail": client.get(f"/v1/jobs/{job_id}", headers=auth),
            "submit": client.post("/v1/jobs", json=make_spec(), headers=auth),
            "metrics": client.get("/metrics"),
            "readyz": client.get("/readyz"),
        }
        for route, answer in away.items():
            assert answer.status_code == 503, (route, answer.status_code, answer.text)
            assert answer.headers["content-type"].startswith("application/problem+json"), route
        for route in ("list", "detail", "submit"):
            assert away[route].headers["retry-after"] == "5"
            assert "database is unavailable" in away[route].json()["detail"]
        assert client.get("/healthz").status_code == 200  # the process itself is fine

        proxy.restore()
        back = client.get("/v1/jobs", headers=auth)
        assert back.status_code == 200, back.text
        assert [job["id"] for job in back.json()["items"]] == [job_id]  # nothing lost, nothing half-stored
        assert client.get("/readyz").status_code == 200
