"""trainer_core/preimport.py: a process's heavy imports with the collector paused, then frozen, and
when such a process may be forked."""

from __future__ import annotations

import gc
import importlib.util
import subprocess
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


def test_a_python_thread_makes_a_process_unsafe_to_fork_and_tqdms_monitor_is_stopped() -> None:
    # In a fresh interpreter: this test process may hold threads that earlier tests left behind.
    script = (
        "import threading\n"
        "from tqdm import tqdm\n"
        "from trainer_core.preimport import stop_tqdm_monitors, unsafe_to_fork\n"
        "print(unsafe_to_fork())\n"
        "for _ in tqdm(range(2), disable=False): pass\n"  # the first bar starts tqdm's monitor thread
        "print(unsafe_to_fork())\n"
        "stop_tqdm_monitors()\n"
        "print(unsafe_to_fork())\n"
        "stop = threading.Event()\n"
        "thread = threading.Thread(target=stop.wait)\n"
        "thread.start()\n"
        "stop_tqdm_monitors()\n"  # stops tqdm's threads only
        "print(unsafe_to_fork())\n"
        "stop.set()\n"
        "thread.join()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines() == ["None", "2 Python threads", "None", "2 Python threads"]
