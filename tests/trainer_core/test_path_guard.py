"""The run checks every local path again as it opens it (trainer_core/path_guard.py), by the rule the
API applies at submit: a data file, a folder read recursively, a model, tokenizer or processor folder
swapped for a link after the submit (or a pattern that now matches one) is refused with a failure
naming the field, before any of it is read. The run's entry (``python -m trainer_core``), each rank's
command line and ``train_job`` itself all carry the reach."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer_core.cli import main as run_cli
from trainer_core.events import EXIT_INVALID_SPEC
from trainer_core.launch import torchrun_command
from trainer_core.path_guard import Reach, check_reach
from trainer_core.rank_entry import main as rank_main
from trainer_core.run import train_job
from trainer_core.spec import JobSpec, SpecError

from .datagen import tiny_image_spec, tiny_text_spec, write_image_folder, write_sentiment_csv


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data root holding bob's own files and alice's upload; a folder of secrets beside it."""
    data = tmp_path / "data"
    write_sentiment_csv(data / "bob", n_train=16, n_val=8)
    write_sentiment_csv(data / "uploads" / "alice" / "ds1", n_train=16, n_val=8)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.csv").write_text("text,label\nthe secret,classified\n")
    return data


def swap_for_link(path: Path, target: Path) -> None:
    """What someone with write access to the data root does after the submit."""
    if path.is_dir():
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
    else:
        path.unlink()
    path.symlink_to(target)


def refused(spec: dict[str, Any], reach: Reach) -> list[str]:
    with pytest.raises(SpecError) as caught:
        check_reach(JobSpec.model_validate(spec), reach)
    return [e.field for e in caught.value.errors]


def text_spec(root: Path, **overrides: Any) -> dict[str, Any]:
    files = {"train": str(root / "bob" / "train.csv"), "validation": str(root / "bob" / "validation.csv")}
    return tiny_text_spec(files, **overrides)


def test_a_data_file_swapped_for_a_link_outside_the_root_is_refused(root: Path) -> None:
    spec, bob = text_spec(root), Reach(str(root), "bob")
    check_reach(JobSpec.model_validate(spec), bob)  # as submitted: fine
    swap_for_link(root / "bob" / "train.csv", root.parent / "outside" / "secret.csv")
    assert refused(spec, bob) == ["dataset.data_files.train"]
    with pytest.raises(SpecError, match="resolves outside the data root"):
        check_reach(JobSpec.model_validate(spec), bob)


def test_a_link_into_another_owners_upload_is_refused_except_for_an_admins_job(root: Path) -> None:
    swap_for_link(root / "bob" / "train.csv", root / "uploads" / "alice" / "ds1" / "train.csv")
    spec = text_spec(root)
    assert refused(spec, Reach(str(root), "bob")) == ["dataset.data_files.train"]
    check_reach(JobSpec.model_validate(spec), Reach(str(root)))  # an admin's job may read every upload


def test_a_pattern_or_a_folder_that_now_reaches_a_link_is_refused(root: Path) -> None:
    bob = Reach(str(root), "bob")
    pattern = text_spec(root, dataset={"data_files": {"train": str(root / "bob" / "*.csv")}})
    images = write_image_folder(root / "bob" / "pics", n_train_per_class=2, n_val_per_class=1)
    folder = tiny_image_spec(images)
    for spec in (pattern, folder):
        check_reach(JobSpec.model_validate(spec), bob)
    (root / "bob" / "extra.csv").symlink_to(root.parent / "outside" / "secret.csv")
    (images / "train" / "red" / "more").symlink_to(root.parent / "outside")
    assert refused(pattern, bob) == ["dataset.data_files.train"]
    assert refused(folder, bob) == ["dataset.data_dir"]


def test_model_tokenizer_and_processor_folders_are_checked_again(root: Path) -> None:
    bob, outside = Reach(str(root), "bob"), root.parent / "outside"
    for name in ("model", "tok", "proc"):
        (root / "bob" / name).mkdir()
        (root / "bob" / name / "config.json").write_text("{}")
    text = text_spec(root)
    text["model"] = {"name_or_path": str(root / "bob" / "model"), "tokenizer": str(root / "bob" / "tok")}
    image = tiny_image_spec(write_image_folder(root / "bob" / "pics", n_train_per_class=2, n_val_per_class=1))
    image["model"] = {"name_or_path": str(root / "bob" / "model"), "processor": str(root / "bob" / "proc")}
    for spec in (text, image):
        check_reach(JobSpec.model_validate(spec), bob)
    swap_for_link(root / "bob" / "tok", outside)
    assert refused(text, bob) == ["model.tokenizer"]
    swap_for_link(root / "bob" / "proc", outside)
    swap_for_link(root / "bob" / "model", outside)
    assert refused(image, bob) == ["model.name_or_path", "model.processor"]
    check_reach(JobSpec.model_validate(image), bob, ("dataset",))  # the data alone is still fine


def test_hub_ids_builders_and_urls_are_not_local_paths(root: Path) -> None:
    spec = tiny_text_spec(
        {"train": "https://example.com/train.csv"}, model={"name_or_path": "google/electra-small-discriminator"}
    )
    spec["model"].pop("config")
    check_reach(JobSpec.model_validate(spec), Reach(str(root), "bob"))
    check_reach(JobSpec.model_validate(text_spec(root)), None)  # a run outside the service: no reach


def test_paths_the_os_refuses_are_refused_with_its_reason(root: Path) -> None:
    (root / "bob" / "loop").symlink_to("loop")
    bob = Reach(str(root), "bob")
    for path, reason in [
        (root / "bob" / ("a" * 300), "ENAMETOOLONG"),
        (root / "bob" / "loop", "ELOOP"),
        (root / "bob" / "train.csv" / "x", "ENOTDIR"),
    ]:
        with pytest.raises(SpecError, match=reason) as caught:
            check_reach(JobSpec.model_validate(text_spec(root, dataset={"data_files": {"train": str(path)}})), bob)
        assert [e.field for e in caught.value.errors] == ["dataset.data_files.train"]


def write_spec(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_the_run_refuses_before_preflight_reads_anything(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m trainer_core ... --data-root --owner``: how the worker starts every run."""
    spec_file = write_spec(tmp_path, text_spec(root))
    swap_for_link(root / "bob" / "train.csv", root.parent / "outside" / "secret.csv")
    args = [str(spec_file), "--output-dir", str(tmp_path / "out"), "--jsonl", "--data-root", str(root)]
    assert run_cli([*args, "--owner", "bob"]) == EXIT_INVALID_SPEC
    out, err = capsys.readouterr()
    done = json.loads(out.strip().splitlines()[-1])
    assert done["event"] == "done" and done["summary"]["reason"] == "data_error"
    assert [e["field"] for e in done["summary"]["errors"]] == ["dataset.data_files.train"]
    assert "classified" not in out + err  # the outside file's label: never read
    assert not (tmp_path / "out" / "config.json").exists()


def test_train_job_checks_again_before_it_prepares_the_data(root: Path, tmp_path: Path) -> None:
    """A swap between the run's start and its data loading (preflight passed) is caught too."""
    events: list[dict[str, Any]] = []
    spec = JobSpec.model_validate(text_spec(root))
    swap_for_link(root / "bob" / "validation.csv", root.parent / "outside" / "secret.csv")
    with pytest.raises(SpecError, match=r"dataset\.data_files\.validation"):
        train_job(spec, tmp_path / "out", emit=events.append, reach=Reach(str(root), "bob"))
    assert events[-1]["event"] == "done" and events[-1]["summary"]["reason"] == "data_error"
    assert not (tmp_path / "out" / "config.json").exists()


def test_every_torchrun_rank_gets_the_reach(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_file = write_spec(tmp_path, text_spec(root))
    swap_for_link(root / "bob" / "train.csv", root.parent / "outside" / "secret.csv")
    cmd = torchrun_command(spec_file, tmp_path / "out", 2, resume=False, stop_file=None, cache_dir=None,
                           reach=Reach(str(root), "bob"))  # fmt: skip
    rank_args = cmd[cmd.index("trainer_core.rank_entry") + 1 :]
    assert rank_args[-4:] == ["--data-root", str(root), "--owner", "bob"]
    # The rank's own entry parses them and refuses the swapped file (exit 2, a spec the run cannot run).
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_main(rank_args) == EXIT_INVALID_SPEC
