"""A process's heavy imports (torch, transformers, datasets, accelerate) at its start, with Python's
cyclic garbage collector paused.

Those imports allocate about a million objects that live as long as the process. The collector runs
every few hundred allocations and, as they pile up, walks them again and again, finding nothing to
free: about 1 s of the ~6.5 s of CPU that importing a backend takes (measured on the 2-core reference
machine, `python -c "import trainer_core.backends.accelerate_backend"` with and without
``gc.disable()``). Every run process, torchrun rank, zygote and API process pays that at its start,
and the test suite starts hundreds of them.

Afterwards ``gc.freeze()`` moves everything imported into the permanent generation, so later full
collections (during training, or an API's requests) skip it too, and a zygote's forked runs do not
write the collector's bits into the pages they share with it.

Once imported, a process is worth forking instead of starting another (a worker slot's zygote forks its
runs, a run forks its torchrun ranks): :func:`unsafe_to_fork` says when that would be wrong.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer_core.spec import JobSpec


def preimport(modules: Iterable[str]) -> dict[str, Exception]:
    """Import ``modules`` with the collector paused, then freeze what exists; the ones that failed,
    with their error (an import that is needed fails again, with the same error, where it is used).

    Safe from any thread and when nested: the collector is enabled again only if it was enabled."""
    enabled = gc.isenabled()
    gc.disable()
    failed: dict[str, Exception] = {}
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as exc:
                failed[name] = exc
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    return failed


def run_modules(spec: JobSpec) -> tuple[str, ...]:
    """What a run of ``spec`` imports before its first step: the engine and the backend it names."""
    from trainer_core.backends import BACKEND_MODULES

    return ("trainer_core.run", BACKEND_MODULES[spec.training.backend])


def unsafe_to_fork() -> str | None:
    """Why forking this process would be wrong, if it would; None when a forked child may go on as it.

    A process that started CUDA cannot hand it to a forked child (the child's CUDA calls fail), a
    torch.distributed process group's connections would be shared with it, and a Python thread could
    hold a lock (logging's, the import lock) that the child inherits taken. The native helper threads
    some libraries start at import (OpenBLAS, jemalloc) reset themselves at fork.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch has initialised CUDA"
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return "it belongs to a torch.distributed process group"
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return "a GPU device is open"
        except OSError:
            continue
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads"
    return None


def stop_tqdm_monitors() -> None:
    """End tqdm's monitor threads, so that a process whose only other thread is one can fork.

    The first progress bar of a process (preflight's, the data's) starts a monitor that wakes every
    10 s under tqdm's lock, and outlives the bar; a child forked while it holds that lock would hang at
    its own first bar. tqdm starts a new monitor with its next bar."""
    monitor = sys.modules.get("tqdm._monitor")
    if monitor is None:
        return
    for thread in threading.enumerate():
        if isinstance(thread, monitor.TMonitor):
            thread.exit()
