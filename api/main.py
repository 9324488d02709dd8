"""The FastAPI app factory: ``create_app(settings)`` builds an app bound to one database and store.

``uvicorn api.main:app`` serves the module-level app built from the environment; ``trainjobs serve``
uses ``api.main:create_app`` as a factory. Routers are a list, so adding one is one line.
"""

from __future__ import annotations

import gc
import importlib
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache

import anyio.to_thread
from fastapi import APIRouter, FastAPI
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api.auth import KeyCache
from api.problems import install_problem_handlers
from api.routes import artifacts, dashboard, datasets, downloads, estimates, events, health, jobs, metrics
from api.routes.prometheus import install_metrics
from api.uploads import UploadLimitMiddleware
from service_core.artifacts import ArtifactStore
from service_core.db.session import make_engine
from service_core.keys import ensure_bootstrap_key
from service_core.settings import Settings, get_settings

logger = logging.getLogger(__name__)

ROUTERS: list[APIRouter] = [
    health.router,
    dashboard.router,
    jobs.router,
    events.router,
    metrics.router,
    artifacts.router,
    downloads.router,
    datasets.router,
    estimates.router,
]

# Threads each API process runs blocking request work on (anyio's default: 40). The work is short
# CPU-bound Python plus database and Redis round trips, and every thread that holds the GIL delays
# the event loop that parses requests and writes answers: bench_api.py measured 40 threads at half
# the submit rate of 8, and 4 at ~1.15x the rate of 8 with the p99 down from ~130 to ~80 ms.
API_THREADS = 4
# Uploads copy, hash and unpack for as long as the file takes: threads of their own, so a few large
# uploads never hold the threads every other route needs (api/routes/datasets.py).
UPLOAD_THREADS = 2
# Connections kept open: one per thread (a thread uses one at a time), so that a burst reuses them
# instead of opening and closing a PostgreSQL connection per request beyond the pool.
API_POOL_SIZE = API_THREADS + UPLOAD_THREADS


def _warm_up(done: threading.Event) -> None:
    # The estimator imports torch and transformers, enqueueing imports Celery (seconds, once): do it
    # at start, off the event loop, rather than in the first submit.
    for module in ("trainer_core.memory", "trainer_core.preflight", "service_core.queue"):
        try:
            importlib.import_module(module)
        except ImportError:
            logger.exception("warm-up import of %s failed", module)
    # Those imports leave ~1M long-lived objects that every full collection would walk again (a
    # stall of 100+ ms every few hundred requests, which set the submit p99). Freezing moves them
    # out of the collector's generations; objects made later are collected as usual.
    gc.freeze()
    done.set()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings

    def bootstrap() -> None:
        with app.state.sessionmaker() as session:
            ensure_bootstrap_key(session, settings)

    anyio.to_thread.current_default_thread_limiter().total_tokens = API_THREADS
    app.state.upload_limiter = anyio.CapacityLimiter(UPLOAD_THREADS)
    await run_in_threadpool(bootstrap)
    threading.Thread(target=_warm_up, args=(app.state.warmed_up,), name="trainjobs-warm-up", daemon=True).start()
    yield
    app.state.engine.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    """An app for ``settings`` (default: from the environment); refuses unsafe production settings."""
    settings = settings or get_settings()
    settings.check_production_ready()
    app = FastAPI(
        title="trainjobs",
        summary="Submit efficient PyTorch training jobs that are checked against GPU memory before they run.",
        version="0.1.0",
        lifespan=lifespan,
    )
    engine = make_engine(settings.database_url, pool_size=API_POOL_SIZE)
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = sessionmaker(bind=engine, expire_on_commit=False)
    app.state.artifacts = ArtifactStore(settings.artifacts_root)
    app.state.key_cache = KeyCache(settings.auth_cache_seconds)
    # Set once the warm-up imports are done (readyz reports it; the first submit no longer waits).
    app.state.warmed_up = threading.Event()
    install_problem_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_metrics(app)
    app.add_middleware(UploadLimitMiddleware, path="/v1/datasets", limit_bytes=settings.max_upload_mb * (1 << 20))
    return app


@lru_cache(maxsize=1)
def _default_app() -> FastAPI:
    return create_app()


def __getattr__(name: str) -> FastAPI:
    # `uvicorn api.main:app`: built on first access, so importing this module has no side effects.
    if name == "app":
        return _default_app()
    raise AttributeError(name)
