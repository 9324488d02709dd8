"""trainer_core/preimport.py: a process's heavy imports with the collector paused, then frozen."""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Iterator

import pytest

from trainer_core.backends import BACKEND_MODULES
from trainer_core.preimport import preimport, run_modules
from trainer_core.spec import parse_spec


@pytest.fixture(autouse=True)
def collector_as_it_was() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    gc.unfreeze()  # this worker's later tests see the generations as usual
    if enabled:
        gc.enable()


def test_imports_report_failures_and_freeze_what_was_imported() -> None:
    sys.modules.pop("colorsys", None)
    gc.unfreeze()
    failed = preimport(("colorsys", "trainer_core.no_such_module"))
    assert "colorsys" in sys.modules
    assert list(failed) == ["trainer_core.no_such_module"]
    assert isinstance(failed["trainer_core.no_such_module"], ModuleNotFoundError)
    # Everything alive at the end, the imported module among it, left the collector's generations.
    assert gc.get_freeze_count() > 0
    assert gc.isenabled()


def test_the_collector_is_paused_while_importing_and_left_as_found() -> None:
    seen: list[bool] = []

    class Probe:  # a finder on sys.meta_path: asked first for each import, it records the collector's state
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name == "trainer_core.probe_module":
                seen.append(gc.isenabled())

    sys.meta_path.insert(0, Probe())  # type: ignore[arg-type]
    try:
        preimport(("trainer_core.probe_module",))
        gc.disable()
        preimport(("trainer_core.probe_module",))
    finally:
        sys.meta_path.pop(0)
    assert seen == [False, False]
    assert not gc.isenabled()  # disabled before, disabled after: a nested call never turns it on


def test_a_run_imports_the_backend_its_spec_names() -> None:
    spec = {"name": "j", "task": "text-classification", "model": {"name_or_path": "m"}, "dataset": {"path": "csv"}}
    for backend, module in BACKEND_MODULES.items():
        parsed = parse_spec({**spec, "training": {"backend": backend}})
        assert run_modules(parsed) == ("trainer_core.run", module)
        assert importlib.util.find_spec(module) is not None, module  # the name run_backend imports
