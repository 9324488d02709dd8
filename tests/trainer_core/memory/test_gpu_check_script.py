"""bench/gpu_memory_check.py: a clear exit without CUDA, and a loop that works (CPU smoke run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_memory_check.py"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV, timeout=300, check=False
    )


def test_without_cuda_it_says_so_and_exits_2() -> None:
    result = run_script()
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr


@pytest.mark.slow
def test_smoke_run_covers_the_grid_with_exact_optimizer_state() -> None:
    result = run_script("--smoke")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("tiny-bert", "tiny-vit"))]
    assert len(rows) == 24  # 2 models x 3 optimizers x checkpointing on/off x fp32/bf16
    assert all(row.endswith("exact") for row in rows), result.stdout
