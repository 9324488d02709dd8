"""The engine's run statuses and exit codes are the service's terminal statuses and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

from service_core.status import EXIT_CODES, EXIT_REFUSED, TERMINAL_STATUSES
from trainer_core.events import EXIT_INVALID_SPEC, RUN_EXIT_CODES, RunStatus


def test_run_statuses_are_the_terminal_job_statuses() -> None:
    assert set(get_args(RunStatus)) == {status.value for status in TERMINAL_STATUSES}


def test_exit_table_equals_the_service_exit_codes() -> None:
    assert {status.value: code for status, code in EXIT_CODES.items()} == RUN_EXIT_CODES
    assert RUN_EXIT_CODES["cancelled"] == 3
    assert EXIT_INVALID_SPEC == EXIT_REFUSED


def test_python_m_trainer_core_refuses_a_bad_spec_with_exit_2(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\ntask: text-classification\nmodel: {config: {model_type: bert}}\n")
    done = subprocess.run([sys.executable, "-m", "trainer_core", str(spec), "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("dataset: "), done.stderr
