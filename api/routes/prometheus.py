"""``GET /metrics``: the service in Prometheus text format.

Job figures (jobs by status, queue depth, job duration, busy worker slots) are read from the database
at scrape time, since the database is the source of truth and several API processes may serve
scrapes. Request latency is measured in-process by :class:`RequestMetricsMiddleware`.

The figures name queues and workers, so ``TRAINJOBS_METRICS_TOKEN`` (when set) makes a scrape send
``Authorization: Bearer <token>`` (Prometheus: ``authorization: {credentials: ...}``); without it,
keep the port private. API keys do not work here: a scraper should hold no key that can submit jobs.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import ColumnElement, case, func, select
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import bearer_key
from api.deps import get_sessionmaker_for
from api.problems import Problem
from service_core.db.models import Job
from service_core.status import JobStatus

router = APIRouter(tags=["observability"])
_METRICS_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="trainjobs-metrics"'}

DURATION_BUCKETS = (10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0, 72 * 3600.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _registry(app: Any) -> CollectorRegistry:
    """The app's own registry (one per app, so several apps in one process do not collide)."""
    state = app.state
    if not hasattr(state, "prometheus_registry"):
        registry = CollectorRegistry()
        state.prometheus_registry = registry
        state.request_latency = Histogram(
            "trainjobs_http_request_duration_seconds",
            "Time to the first byte of the answer, by route template.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
    registry_: CollectorRegistry = state.prometheus_registry
    return registry_


class RequestMetricsMiddleware:
    """Observes the latency of every HTTP request, labelled by route template (not raw path)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # (method, route, status) -> the histogram's child: `labels()` validates and locks on every
        # call, which costs more than the observation itself.
        self._series: dict[tuple[str, str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_and_observe(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                # Time to the start of the answer: meaningful for streams (SSE) as for plain calls.
                route = scope.get("route")
                template = getattr(route, "path", None) or "unmatched"
                fastapi_app = scope.get("app")
                if fastapi_app is not None:
                    labels = (scope["method"], template, str(status["code"]))
                    series = self._series.get(labels)
                    if series is None:
                        _registry(fastapi_app)
                        series = self._series[labels] = fastapi_app.state.request_latency.labels(*labels)
                    series.observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, send_and_observe)


def install_metrics(app: FastAPI) -> None:
    """Add the latency middleware and the ``/metrics`` route to ``app``."""
    app.add_middleware(RequestMetricsMiddleware)
    app.include_router(router)


class JobsCollector(Collector):
    """Job figures from one database snapshot, taken when the collector is built."""

    def __init__(self, session: Session):
        by_status = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples().all())
        self.by_status = {s.value: int(by_status.get(s.value, 0)) for s in JobStatus}
        self.queue_depth = dict(
            session.execute(
                select(Job.queue, func.count()).where(Job.status == JobStatus.queued.value).group_by(Job.queue)
            )
            .tuples()
            .all()
        )
        self.busy: dict[str, int] = {}
        running = select(Job.worker, func.count()).where(Job.status == JobStatus.running.value).group_by(Job.worker)
        for worker, count in session.execute(running).tuples():
            key = worker or "unknown"
            self.busy[key] = self.busy.get(key, 0) + int(count)
        # Bucket counts and the sum in one aggregate query: a scrape reads a row, not every job ever run.
        seconds = run_seconds(session)
        bounds = (*DURATION_BUCKETS, float("inf"))
        counts = [func.coalesce(func.sum(case((seconds <= bound, 1), else_=0)), 0) for bound in DURATION_BUCKETS]
        row = session.execute(
            select(func.count(), func.coalesce(func.sum(seconds), 0.0), *counts).where(
                Job.started_at.is_not(None), Job.finished_at.is_not(None)
            )
        ).one()
        self.duration_count = int(row[0])
        self.duration_sum = float(row[1])
        self.duration_buckets = [*(int(c) for c in row[2:]), self.duration_count]
        self.duration_bounds = bounds

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("trainjobs_jobs", "Jobs by status.", labels=["status"])
        for status, count in self.by_status.items():
            jobs.add_metric([status], count)
        yield jobs
        depth = GaugeMetricFamily("trainjobs_queue_depth", "Queued jobs waiting per queue.", labels=["queue"])
        for queue, count in sorted(self.queue_depth.items()):
            depth.add_metric([queue], int(count))
        yield depth
        busy = GaugeMetricFamily("trainjobs_worker_slots_busy", "Running jobs per worker.", labels=["worker"])
        for worker, count in sorted(self.busy.items()):
            busy.add_metric([worker], int(count))
        yield busy
        yield self._duration_histogram()

    def _duration_histogram(self) -> HistogramMetricFamily:
        buckets = [
            ("+Inf" if bound == float("inf") else repr(bound), float(count))
            for bound, count in zip(self.duration_bounds, self.duration_buckets, strict=True)
        ]
        return HistogramMetricFamily(
            "trainjobs_job_duration_seconds",
            "Run time of finished jobs (start to end).",
            buckets=buckets,
            sum_value=self.duration_sum,
        )


def run_seconds(session: Session) -> ColumnElement[Any]:
    """``finished_at - started_at`` in seconds, as SQL for the session's database."""
    if session.get_bind().dialect.name == "sqlite":
        return (func.julianday(Job.finished_at) - func.julianday(Job.started_at)) * 86400.0
    return func.extract("epoch", Job.finished_at - Job.started_at)


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics(request: Request) -> Response:
    """Prometheus text exposition: job figures from the database, request latency from this process."""
    token: str | None = request.app.state.settings.metrics_token
    sent = bearer_key(request.scope)
    if token and not (sent and hmac.compare_digest(sent.encode(), token.encode())):
        raise Problem(401, "send `Authorization: Bearer <TRAINJOBS_METRICS_TOKEN>`", headers=_METRICS_CHALLENGE)
    with get_sessionmaker_for(request)() as session:
        snapshot = CollectorRegistry()
        snapshot.register(JobsCollector(session))
    body = generate_latest(_registry(request.app)) + generate_latest(snapshot)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)
