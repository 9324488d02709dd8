"""The API process's concurrency settings that bench_api.py measured (issue 4's benchmark)."""

from __future__ import annotations

import anyio.to_thread
from fastapi.testclient import TestClient
from sqlalchemy.pool import QueuePool

from api.main import API_POOL_SIZE, API_THREADS


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
