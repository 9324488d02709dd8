"""A rank's entry for test_launch.py (``-m tests.trainer_core.launch_probe OUT``): its first act is to
write how many ranks its launcher had forked, to OUT/rank-LOCAL_RANK."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from worker.procfs import children_of


def main(argv: list[str]) -> int:
    forked = len(children_of(os.getppid()))
    (Path(argv[0]) / f"rank-{os.environ['LOCAL_RANK']}").write_text(str(forked), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
