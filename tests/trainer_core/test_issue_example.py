"""The issue's example document, unchanged but for its paths, validates and trains through the CLI.

It exercises the hardest combination at once: the accelerate backend, 8-bit AdamW, gradient
accumulation, gradient checkpointing and bf16 autocast, on the real pretrained MiniLM.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainer_core.test_spec import EXAMPLE
from trainer_core.events import parse_event_line
from trainer_core.memory import estimate_memory
from trainer_core.spec import parse_spec
from trainjobs.cli import main


@pytest.mark.slow
def test_issue_example_trains_and_its_memory_matches_the_estimate(
    tmp_path: Path, minilm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = copy.deepcopy(EXAMPLE)
    doc["model"]["name_or_path"] = str(minilm_path)
    doc["dataset"]["data_files"] = write_sentiment_csv(tmp_path / "data", n_train=64, n_val=16)
    doc["training"]["num_train_epochs"] = 1  # the rest of the document is the issue's, unchanged
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(doc))

    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out"), "--jsonl"])

    events = [e for e in map(parse_event_line, capsys.readouterr().out.splitlines()) if e is not None]
    done = events[-1]
    assert (code, done["event"], done["status"]) == (0, "done", "succeeded"), done
    # 64 rows / batch 16 = 4 micro-batches, accumulation 2 -> 2 optimizer steps (bf16 autocast is slow
    # on CPU: the combination is what this checks, not how far it learns)
    assert done["summary"]["global_step"] == 2
    assert {"eval_accuracy", "eval_f1"} <= set(next(e for e in events if e["event"] == "eval")["values"])
    (memory,) = [e for e in events if e["event"] == "memory"]
    estimate = estimate_memory(parse_spec(doc))
    assert memory["values"]["optimizer_state_bytes"] == estimate.optimizer_state_bytes
    assert memory["values"]["parameter_bytes"] == estimate.parameter_bytes
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["eval"] == done["summary"]["eval"]
