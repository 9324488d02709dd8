"""``training.report_to``: both backends mirror their metrics to TensorBoard under <output_dir>/runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_core.runhelpers import BACKENDS, done_event, run, text_spec
from trainer_core.run import TRACKER_PACKAGES, check_runnable
from trainer_core.spec import SpecError


def tensorboard_scalars(log_root: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[float]] = {}
    for event_file in log_root.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(event_file.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return scalars


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensorboard_receives_the_loss_curve(tmp_path: Path, backend: str) -> None:
    spec = text_spec(
        tmp_path / "data", backend, n_train=32,
        training={"max_steps": 4, "logging_steps": 1, "per_device_train_batch_size": 8, "report_to": ["tensorboard"]},
    )
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    scalars = tensorboard_scalars(tmp_path / "out" / "runs")
    logged = [e["values"]["loss"] for e in events.of_kind("metric")]
    loss_tag = next(tag for tag in scalars if tag.endswith("loss") and "eval" not in tag)
    assert scalars[loss_tag] == pytest.approx(logged, rel=1e-5)
    assert any("accuracy" in tag for tag in scalars)


def test_a_tracker_that_is_not_installed_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = text_spec(tmp_path / "data", "trainer", training={"report_to": ["tensorboard"]})
    # Point the check at a package that cannot exist, as on a machine without tensorboard.
    monkeypatch.setitem(TRACKER_PACKAGES, "tensorboard", "tensorboard_not_installed_anywhere")
    with pytest.raises(SpecError) as info:
        check_runnable(spec)
    assert info.value.errors[0].field == "training.report_to.0"
    assert "pip install" in info.value.errors[0].message
