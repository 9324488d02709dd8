"""bench/bench_compile.py on a few steps: bucketed batches repeat shapes and train the same model.

The compiled variants are left to the bench itself: a cold inductor compile of MiniLM takes minutes
on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_compile.py"


def test_bucketed_batches_repeat_shapes_pad_more_and_compute_the_same_loss(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--train", "32", "--batch", "4", "--bucket", "64",
         "--only", "eager,eager-bucketed", "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    eager, bucketed = rows["eager"], rows["eager-bucketed"]
    assert len(eager["losses"]) == len(bucketed["losses"]) == 8
    # Bucketed widths are multiples of 64 up to max_length 256, so at most 4 shapes; eager's follow the data.
    assert all(w % 64 == 0 and w <= 256 for w in bucketed["widths"])
    assert len(set(bucketed["widths"])) < len(set(eager["widths"]))
    assert all(b >= e for b, e in zip(bucketed["widths"], eager["widths"], strict=True))
    assert bucketed["tokens_per_step"] > eager["tokens_per_step"]
    # Nothing compiles eagerly, so nothing is counted as compilation against eager.
    assert eager["compile_steps"] == bucketed["compile_steps"] == 0
    assert bucketed["compile_s"] == 0
    # Padding is masked and dropout is off: the same weights and batches train the same model.
    assert abs(bucketed["losses"][0] - eager["losses"][0]) < 1e-4
    assert max(abs(b - e) for b, e in zip(bucketed["losses"], eager["losses"], strict=True)) < 1e-3
    assert "eager-bucketed" in result.stdout and "break-even steps" in result.stdout
