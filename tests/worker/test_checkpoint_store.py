"""Checkpoints in the object store (a real SeaweedFS over S3): a manifest written last makes one count,
a download is checked file by file, rotation keeps the newest; the slot's uploader keeps one upload in
flight, lets the newest checkpoint wait, survives the run's own rotation and flushes when the run ends."""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import httpx
import pytest

from service_core.checkpoints import MANIFEST, CheckpointError, CheckpointStore
from service_core.settings import Settings
from trainer_core.best_checkpoint import META_KEY as BEST_META_KEY
from trainer_core.checkpoint import META_FILE, checkpoint_dir
from worker.checkpoint_sync import CheckpointUploader, renew_to_commit

from .conftest import JobFactory, load_job
from .test_supervisor import wait_for


def fake_checkpoint(output_dir: Path, step: int, best: int | None = None) -> Path:
    """A checkpoint folder as a backend leaves it: weights in a subfolder, then the meta file, last;
    ``best``: the best step so far its description names, with retention keeping the best."""
    ckpt = checkpoint_dir(output_dir, step)
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "weights.bin").write_bytes(bytes([step % 256]) * (1000 + step))
    (ckpt / "optimizer.pt").write_bytes(f"optimizer at {step}".encode())
    meta: dict[str, Any] = {"global_step": step}
    if best is not None:
        meta |= {"spec": {"training": {"keep_best_checkpoint": True}}, BEST_META_KEY: {"step": best}}
    (ckpt / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    return ckpt


@pytest.fixture
def store(s3_root: str) -> CheckpointStore:
    return CheckpointStore(s3_root, f"job-{uuid.uuid4().hex[:8]}")


def test_a_checkpoint_counts_once_its_manifest_is_written_last(store: CheckpointStore, tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "out", 4)

    def files_before_manifest() -> bool:
        stored = {p.rsplit("/", 1)[-1] for p in store.fs.find(store.step_dir(4))}
        assert stored == {"weights.bin", "optimizer.pt", META_FILE}  # every file is there, no manifest yet
        assert store.steps() == []  # uploaded files without a manifest do not count
        return True

    assert store.upload(ckpt, 4, attempt=2, may_commit=files_before_manifest)
    assert store.steps() == [4]
    manifest = store.manifest(4)
    assert (manifest["step"], manifest["attempt"]) == (4, 2)
    assert {f["path"]: f["size"] for f in manifest["files"]}["model/weights.bin"] == 1004

    # A fenced-out attempt's upload is never committed: its files stay invisible.
    assert not store.upload(fake_checkpoint(tmp_path / "out", 6), 6, attempt=1, may_commit=lambda: False)
    assert store.steps() == [4]

    fetched = store.download(4, tmp_path / "elsewhere")
    assert fetched == checkpoint_dir(tmp_path / "elsewhere", 4)
    for file in ("model/weights.bin", "optimizer.pt", META_FILE):
        assert (fetched / file).read_bytes() == (ckpt / file).read_bytes()
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["checkpoint-4"]  # no partial left


def test_a_download_that_does_not_match_its_manifest_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    store.upload(fake_checkpoint(tmp_path / "out", 2), 2, attempt=1)
    # The object changed behind the manifest's back (same size, other bytes).
    other = fsspec.filesystem("s3", skip_instance_cache=True)
    other.pipe_file(f"{store.files_dir(2, store.manifest(2))}/optimizer.pt", b"optimizer at 9")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is 14 bytes, sha256 .*the manifest says 14 bytes"):
        store.download(2, tmp_path / "resume")
    assert not (tmp_path / "resume").exists() or list((tmp_path / "resume").iterdir()) == []


def test_rotation_keeps_the_newest_and_drops_older_incomplete_uploads(store: CheckpointStore, tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        whole = step != 6
        store.upload(fake_checkpoint(tmp_path / "out", step), step, attempt=1, may_commit=lambda: whole)  # noqa: B023
    assert store.steps() == [2, 4, 8]  # 6 was cut off before its manifest
    assert store.rotate(keep=2) == [2, 6]
    assert store.steps() == [4, 8]
    assert not store.fs.exists(store.step_dir(6)) and not store.fs.exists(store.step_dir(2))
    store.delete(8)
    assert store.steps() == [4]
    assert not store.fs.exists(f"{store.step_dir(8)}/{MANIFEST}")


def test_rotation_keeps_the_best_checkpoint_beside_the_newest(store: CheckpointStore, tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        store.upload(fake_checkpoint(tmp_path / "out", step), step, attempt=1)
    assert store.rotate(keep=1, protect=4) == [2, 6]  # the best (4) is kept on top of the newest
    assert store.steps() == [4, 8]


def test_the_uploader_keeps_one_upload_in_flight_and_the_newest_waiting(store: CheckpointStore, tmp_path: Path) -> None:
    output_dir, work_dir = tmp_path / "output", tmp_path / "work"
    release, committing = threading.Event(), threading.Event()

    def gate() -> bool:  # holds an upload in flight, just before its manifest, until the test releases it
        committing.set()
        assert release.wait(60)
        return True

    uploader = CheckpointUploader(store, output_dir, work_dir / "upload", attempt=1, keep=2, may_commit=gate).start()
    fake_checkpoint(output_dir, 2)
    uploader.poll(force=True)
    assert committing.wait(60) and uploader.in_flight == 2

    # Two more saves while 2 uploads: training does not wait, 6 replaces 4 in the waiting place.
    fake_checkpoint(output_dir, 4)
    uploader.poll(force=True)
    fake_checkpoint(output_dir, 6)
    uploader.poll(force=True)
    assert uploader.in_flight == 2 and [step for step, _ in uploader.waiting] == [6]
    assert sorted(p.name for p in (work_dir / "upload").iterdir()) == ["2", "6"]  # 4's staging is gone
    # The run's own rotation deletes 6 locally before its upload started: the staged links keep it.
    shutil.rmtree(checkpoint_dir(output_dir, 6))
    shutil.rmtree(checkpoint_dir(output_dir, 2))

    release.set()
    wait_for(lambda: uploader.uploaded == [2, 6], 60, "the waiting checkpoint uploaded after the one in flight")
    fake_checkpoint(output_dir, 8)  # saved as the run ends: finish() stages and uploads it
    uploader.finish(timeout_s=60)
    assert uploader.uploaded == [2, 6, 8]
    assert store.steps() == [6, 8]  # save_total_limit 2 applies to the store
    fetched = store.download(6, tmp_path / "check")
    assert (fetched / "model" / "weights.bin").read_bytes() == bytes([6]) * 1006
    assert not (work_dir / "upload").exists()  # staged links removed


def test_the_best_checkpoint_reaches_the_store_though_newer_ones_come_faster(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """Retention keeps the best: the uploader never lets a newer checkpoint replace it, and stages one
    saved between two looks at the folder, so the store holds it beside the newest."""
    output_dir, work_dir = tmp_path / "output", tmp_path / "work"
    release, committing = threading.Event(), threading.Event()

    def gate() -> bool:
        committing.set()
        assert release.wait(60)
        return True

    uploader = CheckpointUploader(store, output_dir, work_dir / "upload", attempt=1, keep=1, may_commit=gate).start()
    fake_checkpoint(output_dir, 2, best=2)
    uploader.poll(force=True)
    assert committing.wait(60) and uploader.in_flight == 2
    fake_checkpoint(output_dir, 4, best=4)
    uploader.poll(force=True)
    fake_checkpoint(output_dir, 6, best=4)  # 4 stays the best: it waits on, 6 behind it
    uploader.poll(force=True)
    assert [step for step, _ in uploader.waiting] == [4, 6]
    fake_checkpoint(output_dir, 8, best=8)
    fake_checkpoint(output_dir, 10, best=8)  # both saved before the next look: 8, the new best, is staged too
    uploader.poll(force=True)
    assert [step for step, _ in uploader.waiting] == [8, 10]  # 4 and 6 superseded
    release.set()
    wait_for(lambda: uploader.uploaded == [2, 8, 10], 60, "the best and the newest uploaded")
    uploader.finish(timeout_s=60)
    assert store.steps() == [8, 10]  # save_total_limit 1 keeps the newest and the best


def test_a_fenced_out_attempt_commits_no_checkpoint(
    store: CheckpointStore, tmp_path: Path, sqlite_settings: Settings, make_job: JobFactory
) -> None:
    job_id = make_job(sqlite_settings, {}, status="running", attempts=2)
    before = load_job(sqlite_settings, job_id).lease_expires_at
    assert renew_to_commit(sqlite_settings, job_id, 2)  # the running attempt renews its lease to commit
    renewed = load_job(sqlite_settings, job_id).lease_expires_at
    assert renewed is not None and (before is None or renewed > before)
    stale = lambda: renew_to_commit(sqlite_settings, job_id, 1)  # noqa: E731  (a newer attempt claimed it)
    output_dir = tmp_path / "output"
    uploader = CheckpointUploader(store, output_dir, tmp_path / "upload", attempt=1, keep=None,
                                  may_commit=stale).start()  # fmt: skip
    fake_checkpoint(output_dir, 2)
    uploader.finish(timeout_s=60)
    assert uploader.uploaded == [] and store.steps() == []


def test_a_stale_attempts_late_writes_change_no_committed_checkpoint(store: CheckpointStore, tmp_path: Path) -> None:
    """A host cut off mid-upload comes back with its requests still in flight: its manifest arrives
    after the window it was signed for and is refused by the store; its files land in its own folder."""
    ckpt = fake_checkpoint(tmp_path / "newer", 4)
    assert store.upload(ckpt, 4, attempt=2, commit_within_s=30)  # the newer attempt commits step 4
    assert store.manifest(4)["folder"] == "attempt-2"
    assert store.fs.exists(f"{store.step_dir(4)}/attempt-2/model/weights.bin")

    # The stale attempt's files for the same step, other bytes, arriving late: they go to attempt-1/.
    stale = fake_checkpoint(tmp_path / "stale", 4)
    (stale / "optimizer.pt").write_bytes(b"stale optimizer")
    assert not store.upload(stale, 4, attempt=1, may_commit=lambda: False)
    # Its manifest PUT, signed while it still held the lease, reaches the store after the window.
    late = store.commit_url(f"{store.step_dir(4)}/{MANIFEST}", within_s=1)
    time.sleep(2.2)
    refused = httpx.put(late, content=json.dumps({"step": 4, "attempt": 1, "folder": "attempt-1"}).encode())
    assert refused.status_code == 403, refused.text
    assert store.manifest(4)["attempt"] == 2
    fetched = store.download(4, tmp_path / "resume")  # every file as the newer attempt's manifest says
    assert (fetched / "optimizer.pt").read_bytes() == (ckpt / "optimizer.pt").read_bytes()


def test_a_renewal_answered_late_commits_nothing_with_a_window_it_no_longer_has(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """A host cut off while its renewal was in flight gets the answer seconds later: the lease it renewed
    may be gone and the job another attempt's. The commit window counts from when the renewal was
    asked, so a late answer leaves too little of it and nothing is committed. (Found by the fleet's
    cut-host test: a manifest signed after such an answer landed in the newer attempt's time.)"""
    from service_core.checkpoints import COMMIT_TRIES, CommitRefused

    asked: list[float] = []

    def late() -> bool:
        asked.append(time.monotonic())
        time.sleep(1.6)  # the answer of a renewal sent before the cut, read after it
        return True

    with pytest.raises(CommitRefused, match="the renewal took"):
        store.upload(fake_checkpoint(tmp_path / "late", 6), 6, attempt=1, may_commit=late, commit_within_s=2)
    assert len(asked) == COMMIT_TRIES and store.steps() == []
    # once a renewal answers in time, the rest of the window is the presigned PUT's. Every later renewal
    # answers at once: on a loaded machine the PUT itself may outlast the second's window (the store
    # answers 403, expired), and the try after it must find a renewal as well (seen: StopIteration).
    answers = iter([1.6])

    def then_fast() -> bool:
        time.sleep(next(answers, 0.0))
        return True

    assert store.upload(fake_checkpoint(tmp_path / "then", 8), 8, attempt=1, may_commit=then_fast, commit_within_s=2)
    assert store.steps() == [8]
