"""``GET /metrics``: the service in Prometheus text format.

Job figures are read from the database at scrape time, since the database is the source of truth and
several API processes may serve scrapes: gauges of the live jobs (queued and running, queue depth, busy
slots per host) counted by index, and counters of finished jobs (by terminal status, and the run-time
histogram) from running totals kept as jobs finish, so a scrape costs the same at 100 jobs or 100,000
and ``trainjobs gc`` never makes a counter go back. Request latency is measured in-process by
:class:`RequestMetricsMiddleware`.

The figures name queues and hosts, so ``TRAINJOBS_METRICS_TOKEN`` (when set) makes a scrape send
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import bearer_key
from api.deps import get_sessionmaker_for
from api.problems import Problem
from service_core.db.models import Job
from service_core.db.totals import (
    DURATION_BUCKETS,
    DURATION_SUM,
    INF_LABEL,
    bucket_key,
    bucket_label,
    finished_key,
    read_totals,
)
from service_core.status import TERMINAL_STATUSES, JobStatus

router = APIRouter(tags=["observability"])
_METRICS_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="trainjobs-metrics"'}

LIVE_STATUSES = (JobStatus.queued.value, JobStatus.running.value, JobStatus.paused.value)
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
    """Job figures from one database snapshot, taken when the collector is built.

    What a scrape reads does not grow with the history: the live jobs (queued and running, through
    ``ix_jobs_status_created``) and the running totals of finished ones (``service_core.db.totals``).
    """

    def __init__(self, session: Session):
        live = (
            select(Job.status, Job.queue, Job.worker, func.count())
            .where(Job.status.in_(LIVE_STATUSES))
            .group_by(Job.status, Job.queue, Job.worker)
        )
        self.live = dict.fromkeys(LIVE_STATUSES, 0)
        self.queue_depth: dict[str, int] = {}
        self.busy: dict[str, int] = {}
        for status, queue, host, count in session.execute(live).tuples():
            self.live[status] += count
            if status == JobStatus.queued.value:
                self.queue_depth[queue] = self.queue_depth.get(queue, 0) + count
            elif status == JobStatus.running.value:
                key = host or "unknown"
                self.busy[key] = self.busy.get(key, 0) + count
        self.totals = read_totals(session)

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("trainjobs_jobs", "Jobs queued or running now.", labels=["status"])
        for status, count in self.live.items():
            jobs.add_metric([status], count)
        yield jobs
        finished = CounterMetricFamily(
            "trainjobs_jobs_finished", "Jobs that reached each terminal status (kept across gc).", labels=["status"]
        )
        for terminal in sorted(TERMINAL_STATUSES):
            finished.add_metric([terminal.value], self.totals.get(finished_key(terminal), 0.0))
        yield finished
        depth = GaugeMetricFamily("trainjobs_queue_depth", "Queued jobs waiting per queue.", labels=["queue"])
        for queue, count in sorted(self.queue_depth.items()):
            depth.add_metric([queue], count)
        yield depth
        # Metric and label names kept as first published (dashboards and alerts use them); the label
        # holds the host name the job row records in its `worker` column.
        busy = GaugeMetricFamily(
            "trainjobs_worker_slots_busy", "Busy slots (running jobs) per host; the label is the host name.",
            labels=["worker"],
        )
        for host, count in sorted(self.busy.items()):
            busy.add_metric([host], count)
        yield busy
        yield self._duration_histogram()

    def _duration_histogram(self) -> HistogramMetricFamily:
        buckets, cumulative = [], 0.0
        for label in (*(bucket_label(b) for b in DURATION_BUCKETS), INF_LABEL):
            cumulative += self.totals.get(bucket_key(label), 0.0)
            buckets.append((label, cumulative))
        return HistogramMetricFamily(
            "trainjobs_job_duration_seconds",
            "Run time of finished jobs (start to end; kept across gc).",
            buckets=buckets,
            sum_value=self.totals.get(DURATION_SUM, 0.0),
        )


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
