"""trainer_core.launch's forked ranks: none starts its work before the launcher has forked them all.

A rank forked while one of the launcher's store threads was inside glibc's resolver hung at its own
first connection (trainer_core/launch.py:_await_sibling_forks says why). Only a process with one
thread forks its ranks: the launcher runs in a child of its own here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RANKS = 4
LAUNCH = """
import sys
from trainer_core.launch import ForkedLauncher
launcher = ForkedLauncher(["--standalone", "--nproc_per_node=%d", "-m", "tests.trainer_core.launch_probe", sys.argv[1]])
launcher.stdout.read()
raise SystemExit(launcher.wait())
"""


def test_every_rank_starts_after_the_launcher_forked_them_all(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", LAUNCH % RANKS, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {path.name: int(path.read_text()) for path in tmp_path.glob("rank-*")}
    assert seen == {f"rank-{rank}": RANKS for rank in range(RANKS)}
