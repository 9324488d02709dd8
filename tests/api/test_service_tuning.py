"""The API process's concurrency settings that bench_api.py measured (issue 4's benchmark)."""

from __future__ import annotations

from typing import Any

import anyio.from_thread
import anyio.to_thread
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.pool import QueuePool

from api.main import API_POOL_SIZE, API_THREADS, UPLOAD_THREADS
from api.routes import datasets
from service_core.db.session import make_engine
from tests.api.conftest import Keys

pytestmark = pytest.mark.both_databases


def _thread_tokens() -> float:
    return anyio.to_thread.current_default_thread_limiter().total_tokens


def test_the_app_runs_blocking_work_on_a_small_threadpool(client: TestClient) -> None:
    # Set at start-up on the app's own event loop (anyio's default is 40).
    assert client.portal is not None
    assert client.portal.call(_thread_tokens) == API_THREADS


def test_a_server_database_pool_keeps_a_connection_per_thread(client: TestClient) -> None:
    pool = client.app.state.engine.pool  # type: ignore[attr-defined]
    url: str = client.app.state.settings.database_url  # type: ignore[attr-defined]
    assert isinstance(pool, QueuePool)
    # SQLite keeps SQLAlchemy's default (5): one writer at a time, and no server backend to start.
    assert pool.size() == (API_POOL_SIZE if url.startswith("postgresql") else 5)


def test_uploads_run_on_threads_of_their_own(
    client: TestClient, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = client.app
    seen: list[tuple[float, float]] = []
    real_store = datasets.save_upload

    def store_and_look(*args: Any, **kwargs: Any) -> Any:
        # Inside the upload's worker thread: which limiter lent it its token?
        upload_limiter = app.state.upload_limiter  # type: ignore[attr-defined]
        seen.append(
            anyio.from_thread.run_sync(
                lambda: (
                    upload_limiter.borrowed_tokens,
                    anyio.to_thread.current_default_thread_limiter().borrowed_tokens,
                )
            )
        )
        return real_store(*args, **kwargs)

    monkeypatch.setattr(datasets, "save_upload", store_and_look)
    files = {"file": ("reviews.csv", b"text,label\ngreat,1\n", "text/csv")}
    response = client.post("/v1/datasets", files=files, headers=keys.auth(keys.alice))
    assert response.status_code == 201, response.text
    assert seen == [(1, 0)]
    assert client.portal is not None
    assert client.portal.call(lambda: app.state.upload_limiter.total_tokens) == UPLOAD_THREADS  # type: ignore[attr-defined]


@pytest.mark.postgres
def test_postgresql_connections_plan_every_execution_with_its_values(pg_url: str) -> None:
    # A generic plan (no parameter values) turns the deep keyset page into a scan of the owner's whole
    # history (bench/history_plans.py): every pooled connection forces custom plans, also after the
    # pool's rollback on return.
    engine = make_engine(pg_url, pool_size=1)
    for _ in range(2):
        with engine.connect() as conn:
            assert conn.execute(text("SHOW plan_cache_mode")).scalar_one() == "force_custom_plan"
            conn.rollback()
    engine.dispose()
