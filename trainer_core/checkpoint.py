"""Self-describing checkpoints: where they live, what describes them, which one to resume from.

A checkpoint is ``output_dir/checkpoint-<step>/``: weights (safetensors), optimizer, scheduler and
RNG states written by the backend, plus ``trainjobs_checkpoint.json`` with the step, the position in
the data and the spec that produced it. That file is written last, so a run killed while saving
leaves a folder without it, which resume ignores.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer_core.spec import FieldError, JobSpec, SpecError

CHECKPOINT_PREFIX = "checkpoint-"
META_FILE = "trainjobs_checkpoint.json"
_STEP = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


@dataclass(frozen=True)
class TrainProgress:
    """Where a run stands: optimizer steps done, the epoch, and batches of it already consumed."""

    global_step: int
    epoch: int
    batch_in_epoch: int


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"{CHECKPOINT_PREFIX}{step}"


def write_meta(
    ckpt: Path, spec: JobSpec, progress: TrainProgress, backend: str, evaluations: dict[str, Any] | None = None
) -> None:
    """Write the description that makes ``ckpt`` complete (call after the backend saved its files).

    ``evaluations``: what the run learned from its evaluations so far (the early stopper's count, the
    best checkpoint), so a resumed run goes on from there (trainer_core/backends/common.RunEvents)."""
    meta = {**asdict(progress), "backend": backend, "spec": spec.model_dump(mode="json"), **(evaluations or {})}
    tmp = ckpt / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    tmp.replace(ckpt / META_FILE)  # atomic: the file is either absent or whole


def read_meta(ckpt: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    return data


def read_progress(ckpt: Path, spec: JobSpec | None = None) -> TrainProgress:
    """The checkpoint's position; with ``spec``, in this run's micro-batches per process.

    A sharded checkpoint resumes on another number of processes (trainer_core/sharding.py), where a
    micro-batch per process covers other rows: with the same global batch, the rows consumed are
    rescaled to this layout. Raises SpecError when the global batch differs (the steps would not line up).
    """
    meta = read_meta(ckpt)
    progress = TrainProgress(meta["global_step"], meta["epoch"], meta["batch_in_epoch"])
    try:
        before = JobSpec.model_validate(meta["spec"]) if spec is not None else None
    except (KeyError, ValueError):  # written by another version: its position is taken as it is
        before = None
    if spec is None or before is None:
        return progress
    rows_before = before.training.per_device_train_batch_size * before.world_size
    rows_now = spec.training.per_device_train_batch_size * spec.world_size
    same_steps = before.global_batch() == spec.global_batch()
    if rows_before == rows_now and same_steps:
        return progress
    if not same_steps:
        raise SpecError([FieldError(
            "training.per_device_train_batch_size", f"the checkpoint at step {progress.global_step} was trained with "
            f"{before.global_batch()} rows a step and this run takes {spec.global_batch()}: resuming on another number "
            "of processes needs the same micro-batch x accumulation x processes",
        )])  # fmt: skip
    return TrainProgress(progress.global_step, progress.epoch, progress.batch_in_epoch * rows_before // rows_now)


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Finished checkpoints in ``output_dir``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _STEP.match(child.name)
        if match and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def newest_checkpoint(output_dir: Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def rotate_checkpoints(output_dir: Path, keep: int | None, protect: int | None = None) -> None:
    """Delete the oldest finished checkpoints so the newest ``keep`` remain (None keeps all), and the one
    at step ``protect`` (the best, trainer_core/best_checkpoint.py) when it is older."""
    if keep is None:
        return
    found = complete_checkpoints(output_dir)
    for old in found[: max(len(found) - keep, 0)]:
        if old.name != f"{CHECKPOINT_PREFIX}{protect}":
            shutil.rmtree(old, ignore_errors=True)
