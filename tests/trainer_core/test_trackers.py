"""W&B and MLflow receive exactly the job's metric points, from either backend.

One tiny run per backend reports to both: W&B offline (its ``.wandb`` file read back), MLflow to a
real ``mlflow server`` (read back with its client). Each must hold the very steps and values of the
run's ``metric`` and ``eval`` events, the spec as config / params, and MLflow the final model.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mlflow_server import MlflowServer
from tests.trainer_core.runhelpers import BACKENDS, done_event, run, text_spec
from trainer_core.events import EventCollector
from trainer_core.run import TRACKER_PACKAGES, check_runnable
from trainer_core.spec import JobSpec, SpecError, parse_spec
from trainer_core.spec_integrations import tracking_uri_problem
from trainer_core.trackers import flatten, parse_links

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of checksummed records
WANDB_HEADER = 7  # ":W&B", a 2-byte magic and a version byte


@pytest.fixture(scope="module", params=BACKENDS)
def tracked_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mlflow_tracking: MlflowServer
) -> Iterator[tuple[JobSpec, EventCollector, Path]]:
    """A 4-step run of ``backend`` reporting to W&B (offline) and MLflow, evaluating every 2 steps."""
    backend = request.param
    tmp = tmp_path_factory.mktemp(f"tracked-{backend}")
    spec = text_spec(
        tmp / "data", backend, n_train=32, n_val=8,
        training={"max_steps": 4, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2,
                  "per_device_train_batch_size": 8, "report_to": ["wandb", "mlflow"]},
        integrations={
            "wandb": {"project": "trainjobs-tests", "name": f"tiny-{backend}", "tags": ["ci", backend]},
            "mlflow": {"tracking_uri": mlflow_tracking.url, "experiment": f"tracked-{backend}", "log_model": True},
        },
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_DIR", str(tmp / "wandb"))
        patch.setenv("WANDB_SILENT", "true")
        status, events = run(spec, tmp / "out")
    assert status == "succeeded", done_event(events)
    yield spec, events, tmp


def job_points(events: EventCollector) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) points, as the job stores them (worker/ingest.py: one per value)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for event in events.events:
        if event["event"] in ("metric", "eval"):
            for name, value in event["values"].items():
                if value is not None:
                    points.setdefault(name, []).append((event["step"], value))
    return points


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf records of an offline run's ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", WANDB_HEADER
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list[Any]) -> dict[str, list[tuple[int, float]]]:
    """Each logged key's (step, value) points; W&B's own keys (``_step``, ``_runtime``...) left out."""
    history: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return history


def test_wandb_holds_the_job_points_and_the_spec(tracked_run: tuple[JobSpec, EventCollector, Path]) -> None:
    spec, events, tmp = tracked_run
    link = events.of_kind("trackers")[0]["links"]["wandb"]
    assert link["url"] is None and link["dir"].startswith(str(tmp / "wandb"))  # offline: a directory, no page
    (run_file,) = (tmp / "wandb").rglob(f"run-{link['run_id']}.wandb")
    records = wandb_records(run_file)
    expected = job_points(events)
    assert {"loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy", "eval_f1"} <= set(expected)
    assert wandb_history(records) == expected
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.project == "trainjobs-tests" and list(run_record.tags) == ["ci", spec.training.backend]
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["training"] == spec.model_dump(mode="json")["training"]


def test_mlflow_holds_the_job_points_the_spec_and_the_model(
    tracked_run: tuple[JobSpec, EventCollector, Path], mlflow_tracking: MlflowServer
) -> None:
    from mlflow import MlflowClient

    spec, events, tmp = tracked_run
    link = events.of_kind("trackers")[0]["links"]["mlflow"]
    experiment = f"tracked-{spec.training.backend}"
    client = MlflowClient(tracking_uri=mlflow_tracking.url)
    run = client.get_run(link["run_id"])
    assert run.info.experiment_id == client.get_experiment_by_name(experiment).experiment_id
    assert link["url"] == f"{mlflow_tracking.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert run.info.status == "FINISHED"
    assert run.data.params == flatten(spec.model_dump(mode="json"))
    expected = job_points(events)
    assert set(run.data.metrics) == set(expected)
    for name, points in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == points, name
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"model/model.safetensors", "model/config.json", "model/spec.json"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp / "dl")))
    assert local.read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()
    assert not any(a.startswith("model/checkpoint-") for a in artifacts)


def test_transformers_own_callbacks_stay_off(tracked_run: tuple[JobSpec, EventCollector, Path]) -> None:
    # The job's points alone reach the trackers: Trainer's WandbCallback / MLflowCallback would add theirs.
    from trainer_core.backends.common import backend_trackers

    spec, _, _ = tracked_run
    assert backend_trackers(spec) == []


def test_a_missing_tracker_package_names_the_field_and_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = text_spec(tmp_path / "data", "trainer", training={"report_to": ["tensorboard", "wandb"]})
    monkeypatch.setitem(TRACKER_PACKAGES, "wandb", "wandb_not_installed_anywhere")
    with pytest.raises(SpecError) as info:
        check_runnable(spec)
    assert info.value.errors[0].field == "training.report_to.1"
    assert "pip install 'trainjobs[wandb]'" in info.value.errors[0].message


def test_an_integration_needs_its_tracker_in_report_to(tmp_path: Path) -> None:
    base = text_spec(tmp_path / "data", "trainer").model_dump(mode="json", exclude_unset=True)
    with pytest.raises(SpecError) as info:
        parse_spec({**base, "integrations": {"mlflow": {"experiment": "x"}}})
    assert [e.field for e in info.value.errors] == ["integrations.mlflow"]
    with pytest.raises(SpecError) as info:
        parse_spec({**base, "integrations": {"wandb": {"project": "p", "api_key": "never here"}}})
    assert info.value.errors[0].field == "integrations.wandb.api_key"  # keys never come from a spec


@pytest.mark.parametrize(
    ("uri", "private_ok", "problem"),
    [
        ("https://8.8.8.8:5000", False, None),
        ("http://127.0.0.1:5000", False, "non-public address 127.0.0.1"),
        ("http://10.1.2.3", False, "non-public"),
        ("http://mlflow.internal", False, "private network"),
        ("http://127.0.0.1:5000", True, None),
        ("file:///srv/mlruns", True, "http(s)"),
        ("sqlite:///tmp/mlflow.db", False, "http(s)"),
    ],
)
def test_tracking_uri_rule(uri: str, private_ok: bool, problem: str | None) -> None:
    found = tracking_uri_problem(uri, allow_private=private_ok)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_only_well_formed_links_are_kept() -> None:
    # The run is the user's code: a `trackers` line it prints must not put a script link on the dashboard.
    links = parse_links({
        "wandb": {"url": "javascript:alert(1)", "run_id": "abc", "dir": "/w"},
        "mlflow": {"url": "https://mlflow.example.com/#/experiments/1/runs/r", "run_id": "r", "experiment_id": "1"},
        "other": {"url": "https://x", "run_id": "y"},
    })  # fmt: skip
    assert links == {
        "wandb": {"url": None, "run_id": "abc", "experiment_id": None, "dir": "/w"},
        "mlflow": {"url": "https://mlflow.example.com/#/experiments/1/runs/r", "run_id": "r", "experiment_id": "1",
                   "dir": None},
    }  # fmt: skip
    assert parse_links("not a mapping") == {} and parse_links({"wandb": {"url": "https://x"}}) == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_continues_the_same_tracker_runs(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # so: the job's own store, <output_dir>/mlflow.db
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = text_spec(
        tmp_path / "data", backend, n_train=32, n_val=8,
        training={"max_steps": 4, "logging_steps": 1, "save_steps": 2, "eval_strategy": "no",
                  "per_device_train_batch_size": 8, "report_to": ["wandb", "mlflow"]},
    )  # fmt: skip
    out = tmp_path / "out"
    status, first = run(spec, out)
    assert status == "succeeded", done_event(first)
    shutil.rmtree(out / "checkpoint-4")  # as if the run died after step 4's points, before its checkpoint
    status, second = run(spec, out, resume=True)
    assert status == "succeeded", done_event(second)

    links = [events.of_kind("trackers")[0]["links"] for events in (first, second)]
    # The same runs continue; an offline W&B run writes each session to a directory of its own.
    assert links[0]["wandb"]["run_id"] == links[1]["wandb"]["run_id"] and links[0]["mlflow"] == links[1]["mlflow"]
    assert links[0]["mlflow"]["url"] is None  # a local store has no page
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run_id = links[0]["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert [step for step, _ in losses] == [1, 2, 3, 3, 4, 4]  # steps 3 and 4 again, after the checkpoint
    assert losses == sorted(job_points(first)["loss"] + job_points(second)["loss"])
