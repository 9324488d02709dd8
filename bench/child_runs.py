"""One benchmark run per child process, so each reports its own peak memory (bench_llm.py and
bench_preference.py).

A run in the bench's own process would share its peak with every run before it: ``ru_maxrss`` only
grows. Each run is therefore ``python <script> --child ...`` and prints its result as the last stdout
line, with ``peak_rss_mb``: its own ``ru_maxrss`` (imports, data and training alike on both sides).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from typing import Any


def report(result: dict[str, Any]) -> None:
    """In the child: print ``result`` with this process's peak RSS (``ru_maxrss`` is KiB on Linux)."""
    print(json.dumps({**result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_child(script: str, argv: list[str], what: str) -> dict[str, Any]:
    """Run ``script`` with ``argv`` in a fresh interpreter; its :func:`report`, or exit naming ``what``."""
    done = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
