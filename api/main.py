"""The FastAPI app factory: ``create_app(settings)`` builds an app bound to one database and store.

``uvicorn api.main:app`` serves the module-level app built from the environment; ``trainjobs serve``
uses ``api.main:create_app`` as a factory. Routers are a list, so adding one is one line.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache

import anyio.to_thread
from fastapi import APIRouter, FastAPI
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api.auth import AuthGateMiddleware, KeyCache
from api.event_feed import JobWakeups, SharedReads
from api.event_listeners import ListenerState, start_event_feed
from api.fast_path import install_fast_paths
from api.openapi import install_openapi
from api.problems import install_problem_handlers
from api.quotas import QuotaMiddleware, RateLimiter
from api.routes import (
    artifacts,
    checkpoints,
    dashboard,
    datasets,
    downloads,
    estimates,
    events,
    health,
    jobs,
    keys,
    logs,
    metrics,
    usage,
    webhooks,
)
from api.routes.prometheus import install_metrics
from api.streams import StreamSlots
from api.uploads import BodyLimitMiddleware
from service_core.artifacts import ArtifactStore
from service_core.db.session import make_engine
from service_core.keys import ensure_bootstrap_key
from service_core.settings import Settings, get_settings
from trainer_core.preimport import preimport

logger = logging.getLogger(__name__)

# The busiest first: a request is matched against each route in turn (no two routers share a path),
# and an estimate, behind 22 routes, spent a sixth of its time in routing. The estimates' four routes
# go before the jobs' six, which a submit then passes at a cost of four matches.
ROUTERS: list[APIRouter] = [
    health.router,
    estimates.router,
    jobs.router,
    events.router,
    metrics.router,
    logs.router,
    artifacts.router,
    downloads.router,
    checkpoints.router,
    datasets.router,
    keys.router,
    usage.router,
    webhooks.router,
    dashboard.router,
]

# Threads each API process runs blocking request work on (anyio's default: 40). The work is short
# CPU-bound Python plus database and Redis round trips, and every thread that holds the GIL delays
# the event loop that parses requests and writes answers: bench_api.py measured 40 threads at half
# the submit rate of 8, and 4 at ~1.15x the rate of 8 with the p99 down from ~130 to ~80 ms.
API_THREADS = 4
# Uploads copy, hash and unpack for as long as the file takes: threads of their own, so a few large
# uploads never hold the threads every other route needs (api/routes/datasets.py).
UPLOAD_THREADS = 2
# Event-stream reads (a woken stream's new rows, the last_seq watcher's query): threads of their own,
# so many open streams never queue in front of the requests every other route serves
# (api/routes/events.py, api/event_listeners.py).
STREAM_THREADS = 2
# /readyz checks the database and the broker on a thread of its own: it answers while all else is busy.
READY_THREADS = 1
# Request sessions open at once (api/deps.get_db); each holds a connection from its first query.
SESSION_SLOTS = 2 * API_THREADS
# Connections kept open: every user of the pool is bounded (each thread uses at most one at a time,
# request sessions by SESSION_SLOTS), so no request waits for a connection or times out on one, and
# a burst reuses them instead of opening and closing a PostgreSQL connection per request.
API_POOL_SIZE = API_THREADS + UPLOAD_THREADS + STREAM_THREADS + READY_THREADS + SESSION_SLOTS


def _warm_up(done: threading.Event) -> None:
    # The estimator imports torch and transformers, enqueueing imports Celery (seconds, once): do it
    # at start, off the event loop, rather than in the first submit.
    # Those imports leave ~1M long-lived objects that every full collection would walk again (a
    # stall of 100+ ms every few hundred requests, which set the submit p99). preimport pauses the
    # collector while importing and then freezes them out of its generations; objects made later
    # are collected as usual.
    for module, exc in preimport(("trainer_core.memory", "trainer_core.preflight", "service_core.queue")).items():
        logger.error("warm-up import of %s failed", module, exc_info=exc)
    done.set()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings

    def bootstrap() -> None:
        with app.state.sessionmaker() as session:
            ensure_bootstrap_key(session, settings)

    anyio.to_thread.current_default_thread_limiter().total_tokens = API_THREADS
    app.state.upload_limiter = anyio.CapacityLimiter(UPLOAD_THREADS)
    app.state.stream_limiter = anyio.CapacityLimiter(STREAM_THREADS)
    app.state.ready_limiter = anyio.CapacityLimiter(READY_THREADS)
    app.state.session_slots = anyio.CapacityLimiter(SESSION_SLOTS)
    await run_in_threadpool(bootstrap)
    threading.Thread(target=_warm_up, args=(app.state.warmed_up,), name="trainjobs-warm-up", daemon=True).start()
    # Event streams wait on these, woken by one listener / watcher per process (api/event_listeners.py).
    app.state.event_wakeups, app.state.event_reads = JobWakeups(), SharedReads()
    app.state.event_listener = ListenerState()
    feed = start_event_feed(
        settings.database_url, app.state.sessionmaker, app.state.event_wakeups, app.state.event_listener,
        app.state.stream_limiter,
    )  # fmt: skip
    yield
    for task in feed:
        task.cancel()
    await asyncio.gather(*feed, return_exceptions=True)
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
        # /docs and /redoc are served from package files by api/routes/dashboard.py (FastAPI's own
        # load Swagger UI and ReDoc from a CDN: blank pages on an air-gapped cluster).
        docs_url=None,
        redoc_url=None,
    )
    engine = make_engine(settings.database_url, pool_size=API_POOL_SIZE)
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = sessionmaker(bind=engine, expire_on_commit=False)
    app.state.artifacts = ArtifactStore(settings.artifacts_root)
    app.state.key_cache = KeyCache(settings.auth_cache_seconds)
    app.state.stream_slots = StreamSlots(settings.max_streams_per_owner, settings.max_streams)
    app.state.rate_limiter = RateLimiter({"submit": settings.submits_per_minute, "upload": settings.uploads_per_minute})
    # Set once the warm-up imports are done (readyz reports it; the first submit no longer waits).
    app.state.warmed_up = threading.Event()
    install_problem_handlers(app)
    install_openapi(app)
    for router in ROUTERS:
        app.include_router(router)
    # Ahead of every route: the usual submit and estimate skip FastAPI's dependency solving (issue 25)
    install_fast_paths(app, [*jobs.FAST_PATHS, *estimates.FAST_PATHS])
    app.mount(dashboard.STATIC_URL, dashboard.static_files(), name="static")
    install_metrics(app)
    app.add_middleware(
        BodyLimitMiddleware,
        upload_path="/v1/datasets",
        upload_limit=settings.max_upload_mb * (1 << 20),
        json_limit=settings.max_json_kb * 1024,
    )
    # Added last, so they run first: no body is read before the key and the caller's rate are checked.
    app.add_middleware(QuotaMiddleware)
    app.add_middleware(AuthGateMiddleware)
    return app


@lru_cache(maxsize=1)
def _default_app() -> FastAPI:
    return create_app()


def __getattr__(name: str) -> FastAPI:
    # `uvicorn api.main:app`: built on first access, so importing this module has no side effects.
    if name == "app":
        return _default_app()
    raise AttributeError(name)
