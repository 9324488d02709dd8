"""bench/suite_profile.py: the processes a test starts are charged to its module, by kind, with the
CPU they used; checked on a tiny suite of its own, sampled for real, and on made-up samples."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from suite_profile import FORKED_RUN, Seen, summarize

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "suite_profile.py"


def test_a_test_that_starts_a_busy_process_is_charged_its_cpu(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_busy.py").write_text(textwrap.dedent("""
        import subprocess, sys

        def test_idle():
            pass

        def test_busy():
            burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.8: pass"
            subprocess.run([sys.executable, "-c", burn], check=True)
    """))
    out = tmp_path / "profile.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--interval", "0.1", "--out", str(out), "--", str(suite), "-q",
         "-p", "no:cacheprovider", "-p", "no:xdist"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    profile = json.loads(out.read_text())
    # The module's node id is relative to the suite's root, which pytest picks: the tmp folder or above.
    (charged,) = [row for module, row in profile["modules"].items() if module.endswith("test_busy.py")]
    assert 0.6 <= charged["cpu_s"] < 5 and charged["processes"] == {"other": 1}, charged
    assert profile["busy"] and all(0 <= share <= 1 for _, share in profile["busy"])
    assert "test_busy.py" in result.stdout and "busy share of all cores" in result.stdout


def test_processes_are_charged_to_the_test_running_on_the_worker_they_descend_from() -> None:
    worker, other_worker = 100, 200
    events = [
        {"event": "worker", "pid": worker, "worker": "gw0"},
        {"event": "worker", "pid": other_worker, "worker": "gw1"},
        {"event": "start", "time": 10.0, "test": "tests/a.py::one", "worker": "gw0"},
        {"event": "start", "time": 20.0, "test": "tests/b.py::two[x]", "worker": "gw0"},
        {"event": "start", "time": 5.0, "test": "tests/c.py::three", "worker": "gw1"},
    ]
    seen = [
        Seen(worker, 1, 0, "python -u -c import sys;exec(eval(sys.stdin.readline()))", 0.0, 40.0),
        Seen(101, worker, 0, "python -m trainjobs.cli serve --port 1", 12.0, 3.0),  # during a.py
        Seen(102, worker, 0, "python -m worker.main --queues q", 21.0, 1.5),  # during b.py
        Seen(103, 102, 0, "python -m worker.zygote 5 trainjobs-run", 21.5, 5.0),  # b.py's, one level down
        Seen(104, 103, 0, "python -m worker.zygote 5 trainjobs-run", 22.0, 2.0),  # a run it forked
        Seen(201, other_worker, 0, "/usr/bin/chromium --headless", 6.0, 4.0),
        Seen(300, 1, 0, "postgres: checkpointer", 0.0, 1.0),  # not the suite's: no module
    ]
    summary = summarize(seen, events)
    assert summary["modules"] == {
        "tests/b.py": {"cpu_s": 8.5, "processes": {"worker main": 1, "worker zygote": 1, FORKED_RUN: 1}},
        "tests/c.py": {"cpu_s": 4.0, "processes": {"Chromium": 1}},
        "tests/a.py": {"cpu_s": 3.0, "processes": {"API process": 1}},
    }
    assert summary["kinds"]["worker zygote"] == {"processes": 1, "cpu_s": 5.0}
    assert summary["kinds"][FORKED_RUN] == {"processes": 1, "cpu_s": 2.0}
    assert summary["kinds"]["xdist worker (in-process tests)"] == {"processes": 1, "cpu_s": 40.0}
    assert summary["cpu_s"] == 56.5
