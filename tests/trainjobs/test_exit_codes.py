"""One exit code per end state in every command that waits for a job (service_core.status.EXIT_CODES).

``submit --follow`` and ``jobs logs --follow`` are driven against a live service in
test_live_service.py (a cancelled job's follow exits 3); this pins ``train`` to the same table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service_core.status import EXIT_CODES, JobStatus, exit_code
from tests.trainer_core.runhelpers import text_spec
from trainer_core.events import parse_event_line
from trainjobs.cli import main


def test_every_end_state_has_its_own_exit_code() -> None:
    assert set(EXIT_CODES) == {s for s in JobStatus if s.terminal}
    assert EXIT_CODES[JobStatus.succeeded] == 0
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES)
    assert exit_code("no-such-status") == EXIT_CODES[JobStatus.failed]


def test_a_cancelled_local_run_exits_as_a_cancelled_followed_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = text_spec(tmp_path / "data", "accelerate", n_train=16, n_val=8,
                     training={"max_steps": 4, "logging_steps": 2, "per_device_train_batch_size": 8})  # fmt: skip
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    stop_file = tmp_path / "STOP"
    stop_file.touch()  # what the worker does to cancel a run: it stops after its first step
    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out"), "--jsonl",
                 "--stop-file", str(stop_file)])  # fmt: skip
    events = [e for e in map(parse_event_line, capsys.readouterr().out.splitlines()) if e is not None]
    assert events[-1]["event"] == "done" and events[-1]["status"] == "cancelled"
    assert code == EXIT_CODES[JobStatus.cancelled] == 3
