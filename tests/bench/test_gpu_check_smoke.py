"""bench/gpu_check.py: a clear exit without CUDA, and every row of the table from a CPU smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
OPTIMIZERS = ("adamw", "adafactor", "adamw_8bit")


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV, timeout=600, check=False
    )


def test_without_cuda_it_says_so_and_exits_2() -> None:
    result = run_script()
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr


def test_an_unknown_section_is_refused() -> None:
    result = run_script("--smoke", "--only", "memory,speed")
    assert result.returncode == 2
    assert "speed" in result.stderr


@pytest.mark.slow
def test_smoke_run_prints_and_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "table.json"
    # Its runs forked as a worker slot forks them: seven fresh interpreters would each import torch first.
    result = run_script("--smoke", "--fork-runs", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["smoke"] is True
    rows = {(r["section"], r["check"]): r for r in report["rows"]}
    assert len(rows) == len(report["rows"])  # no check twice

    expected_memory = {
        f"{model} {opt} ckpt={ckpt} {mp}"
        for model in ("tiny-bert", "tiny-vit") for opt in OPTIMIZERS for ckpt in ("off", "on")
        for mp in ("fp32", "bf16")
    } | {"tiny-bert adamw ckpt=off fp16", "tiny-vit adamw ckpt=off fp16"}  # fmt: skip
    memory = {check: r for (section, check), r in rows.items() if section == "memory"}
    # bench/gpu_llm.py; on the CPU without Liger's rows (Triton kernels need CUDA)
    llm = {f"tiny-llama {kind} fp32" for kind in ("full", "lora", "qlora", "lora chunked-loss")}
    assert set(memory) == expected_memory | llm
    # On the CPU the static parts are what can be checked: they must match the estimate to the byte.
    assert all(r["status"] == "PASS" and "optimizer state exact" in r["detail"]
               for check, r in memory.items() if check not in llm), memory  # fmt: skip
    assert all(memory[c]["status"] == "PASS" and "params/grads/optimizer exact" in memory[c]["detail"] for c in llm)

    throughput = {check for (section, check) in rows if section == "throughput"}
    assert throughput == {"tutorial Trainer (pad to max_length)", "tuned Trainer (dyn. padding + group_by_length)",
                          "trainjobs trainer", "trainjobs accelerate"}  # fmt: skip
    assert rows[("mfu", "tiny-bert training step")]["status"] == "INFO"

    for backend in ("trainer", "accelerate"):
        for check in (f"SIGKILL-resume [{backend}]", f"cancel (SIGTERM) [{backend}]"):
            assert rows[("faults", check)]["status"] == "PASS", rows[("faults", check)]
    oom = rows[("faults", "OOM fault -> reason out_of_memory")]
    assert oom["status"] == "PASS", oom  # the testing aid exists (trainer_core/oom_fault.py): no skipping

    assert all(r["status"] != "ERROR" for r in report["rows"])
    for section, check in rows:  # the printed table has the same rows
        assert any(line.startswith(section) and check in line for line in result.stdout.splitlines()), check
