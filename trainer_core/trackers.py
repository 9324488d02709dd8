"""W&B and MLflow mirrors of a run: exactly the metric points the job streams, from one place.

Both backends emit their ``metric`` and ``eval`` events through one sink; :class:`TrackerRuns` sits
on that sink, so each tracker receives the values the job stores, at the same steps, whichever
backend trained (transformers' own W&B and MLflow callbacks stay off: they would log other points).
TensorBoard stays with the backends (``<output_dir>/runs``).

The runs start before training and report where they are in a ``trackers`` event (the service keeps
it as ``jobs.tracker_links``); they end just before the run's ``done`` event passes, MLflow's first
uploading the final model when ``integrations.mlflow.log_model`` asks for it. A resumed run continues
the same tracker runs (their ids are kept in ``<output_dir>/trackers.json``).

Credentials come from the environment the worker passes (worker/run_env.py), never from the spec. A
tracker that cannot start fails the run; one that fails to take a point later is logged and skipped.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from trainer_core.events import Event, EventSink, make_event
from trainer_core.spec import JobSpec

logger = logging.getLogger(__name__)

MIRRORED_TRACKERS = ("wandb", "mlflow")
IDS_FILE = "trackers.json"
LINK_FIELDS = ("url", "run_id", "experiment_id", "dir")
# What the final model directory holds besides the model: checkpoints and the trackers' own files.
NOT_MODEL = ("runs", "wandb", "mlflow.db", "mlflow-artifacts", IDS_FILE)


class _Tracker(Protocol):
    link: dict[str, Any]

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def finish(self, status: str, output_dir: Path) -> None: ...


def parse_links(value: Any) -> dict[str, dict[str, str | None]]:
    """The well-formed part of a ``trackers`` event's ``links``, as the service stores it: the run is the
    user's code and may print any line, so only known trackers, string fields, and http(s) page URLs."""
    links: dict[str, dict[str, str | None]] = {}
    if not isinstance(value, Mapping):
        return links
    for name in MIRRORED_TRACKERS:
        link = value.get(name)
        if not isinstance(link, Mapping) or not isinstance(link.get("run_id"), str):
            continue
        kept = {k: link.get(k) if isinstance(link.get(k), str) else None for k in LINK_FIELDS}
        if not str(kept["url"] or "").startswith(("http://", "https://")):
            kept["url"] = None
        links[name] = kept
    return links


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested spec as ``{"training.learning_rate": "5e-05", ...}`` (MLflow params are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, list | dict) else str(value)
    return flat


def numeric_values(event: Event) -> dict[str, float]:
    """The event's values that are numbers (a non-finite one arrives as None and is left out)."""
    values = event.get("values") or {}
    return {str(k): float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class _Wandb:
    def __init__(self, spec: JobSpec, output_dir: Path, run_id: str | None) -> None:
        import wandb

        cfg = spec.integrations.wandb if spec.integrations and spec.integrations.wandb else None
        self.run = wandb.init(
            project=(cfg.project if cfg else None) or spec.name,
            entity=cfg.entity if cfg else None,
            name=(cfg.name if cfg else None) or spec.name,
            tags=list(cfg.tags) if cfg else None,
            config=spec.model_dump(mode="json"),
            dir=os.environ.get("WANDB_DIR") or str(output_dir),  # the run's files beside its output by default
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",  # several runs in one process (notebooks, tests) stay apart
        )
        offline = self.run.settings.mode in ("offline", "dryrun")
        self.link = {"url": None if offline else self.run.url, "run_id": self.run.id, "dir": self.run.dir}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def finish(self, status: str, output_dir: Path) -> None:
        self.run.finish(exit_code=0 if status == "succeeded" else 1)


class _Mlflow:
    def __init__(self, spec: JobSpec, output_dir: Path, run_id: str | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        cfg = spec.integrations.mlflow if spec.integrations and spec.integrations.mlflow else None
        # The spec's server, else the operator's, else a store of the job's own (like TensorBoard's runs/).
        uri = (cfg.tracking_uri if cfg else None) or os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = uri or f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
        self.log_model = bool(cfg and cfg.log_model)
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            name = (cfg.experiment if cfg else None) or spec.name
            found = self.client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=spec.name).info.run_id
            params = [Param(k, v) for k, v in flatten(spec.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")  # a resumed run: running again
        self.run_id = run_id
        experiment_id = self.client.get_run(run_id).info.experiment_id
        remote = self.uri.startswith(("http://", "https://"))
        url = f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}" if remote else None
        self.link = {"url": url, "run_id": run_id, "experiment_id": experiment_id}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, status: str, output_dir: Path) -> None:
        if status == "succeeded" and self.log_model:
            for entry in sorted(output_dir.iterdir()):
                if entry.name.startswith("checkpoint-") or entry.name in NOT_MODEL:
                    continue
                if entry.is_dir():
                    self.client.log_artifacts(self.run_id, str(entry), f"model/{entry.name}")
                else:
                    self.client.log_artifact(self.run_id, str(entry), "model")
        ended = {"succeeded": "FINISHED", "cancelled": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, ended)


_OPENERS: dict[str, Callable[[JobSpec, Path, str | None], _Tracker]] = {"wandb": _Wandb, "mlflow": _Mlflow}


class TrackerRuns:
    """The run's W&B and MLflow runs (none when ``report_to`` names neither); :meth:`sink` feeds them."""

    def __init__(self, spec: JobSpec, output_dir: Path, *, resume: bool) -> None:
        self.output_dir = output_dir
        self.trackers: dict[str, _Tracker] = {}
        wanted = [t for t in spec.training.report_to if t in MIRRORED_TRACKERS]
        if not wanted:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        ids_file = output_dir / IDS_FILE
        ids = json.loads(ids_file.read_text(encoding="utf-8")) if resume and ids_file.is_file() else {}
        try:
            for name in wanted:
                self.trackers[name] = _OPENERS[name](spec, output_dir, ids.get(name))
        except BaseException:
            self.close("failed")
            raise
        ids_file.write_text(json.dumps({n: t.link["run_id"] for n, t in self.trackers.items()}), encoding="utf-8")

    @property
    def links(self) -> dict[str, dict[str, Any]]:
        """Where each tracker's run is: ``url`` (None for a local or offline run), ``run_id`` and more."""
        return {name: tracker.link for name, tracker in self.trackers.items()}

    def sink(self, downstream: EventSink) -> EventSink:
        """``downstream`` with every ``metric`` and ``eval`` point mirrored, and the runs closed before
        ``done`` passes. Announces the runs' links downstream first (a ``trackers`` event)."""
        if not self.trackers:
            return downstream
        downstream(make_event("trackers", links=self.links))

        def emit(event: Event) -> None:
            kind = event.get("event")
            if kind in ("metric", "eval"):
                self._log(int(event.get("step") or 0), numeric_values(event))
            elif kind == "done":
                self.close(str(event.get("status")))
            downstream(event)

        return emit

    def _log(self, step: int, values: dict[str, float]) -> None:
        if not values:
            return
        for name, tracker in self.trackers.items():
            try:
                tracker.log(step, values)
            except Exception:  # a mirror's outage must not end the training it mirrors
                logger.exception("%s did not take the points of step %d", name, step)

    def close(self, status: str) -> None:
        """End every tracker run (``status``: how the job's run ended); later calls do nothing."""
        trackers, self.trackers = self.trackers, {}
        for name, tracker in trackers.items():
            try:
                tracker.finish(status, self.output_dir)
            except Exception:
                logger.exception("%s did not finish its run", name)

    def __enter__(self) -> TrackerRuns:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close("failed")  # only runs not closed by a `done` event: the run ended without one
