"""Both data roots for the API tests: the local folder of ``settings`` and a prefix of the session's
SeaweedFS (``DATA_ROOT=s3://...``). A module imports :func:`settings_on_both_roots` to run its tests
on each; ``@pytest.mark.parametrize("settings", ["local"], indirect=True)`` keeps one test on one."""

from __future__ import annotations

import posixpath
import shutil

import pytest

from service_core.datastore import DataStore
from service_core.settings import Settings

ROOTS = ["local", "s3"]


@pytest.fixture(name="settings", params=ROOTS)
def settings_on_both_roots(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """``settings`` as they are (local), or with their data moved to a fresh s3:// prefix."""
    if request.param == "local":
        return settings
    root: str = request.getfixturevalue("s3_root")
    DataStore(root).put_folder(settings.data_root, "")
    shutil.rmtree(settings.data_root)  # nothing may read the local copy any more
    return settings.model_copy(update={"data_root_": root})


def put(settings: Settings, relative: str, content: bytes) -> str:
    """Write ``content`` at ``relative`` under the data root, whichever kind; returns its location."""
    store = DataStore.of(settings)
    path = f"{store.base}/{relative}"
    store.fs.makedirs(posixpath.dirname(path), exist_ok=True)
    store.fs.pipe_file(path, content)
    return store.location(relative)


def read(settings: Settings, relative: str) -> bytes:
    """The bytes at ``relative`` under the data root."""
    store = DataStore.of(settings)
    content: bytes = store.fs.cat_file(f"{store.base}/{relative}")
    return content
