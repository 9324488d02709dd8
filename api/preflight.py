"""Preflight as the API runs it: in its own thread with a deadline, so a slow disk cannot hold a submit.

The checks themselves are :func:`trainer_core.preflight.preflight` (imported on first use: it loads
datasets and transformers). Its :class:`~trainer_core.preflight.PreflightError` is a SpecError, which
the problem handlers turn into a 422 naming each field.

A passing report is remembered per :func:`~trainer_core.preflight.preflight_key` (the spec parts
preflight reads and the stat of each file it reads), so resubmitting a spec over unchanged data
costs a few ``stat`` calls instead of parsing the data again (~13 ms of the ~20 ms of API CPU a
submit took; bench_api.py submits the same spec thousands of times, as sweeps and retries do).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from api.problems import Problem
from trainer_core.spec import JobSpec

PREFLIGHT_TIMEOUT_S = 10.0
# How long a submit that arrives while the app still imports datasets and transformers waits for that
# warm-up before a 503: on a loaded machine it takes well over PREFLIGHT_TIMEOUT_S (the chaos bench saw
# a first submit meet a half-initialised transformers, a 500, on a 2-core machine at load 13).
WARM_UP_WAIT_S = 60.0
# A few threads: preflight reads are bounded, and a timed-out one still finishes on its own.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="preflight")
PASSED_MEMO_SIZE = 256


class PassedReports:
    """The last :data:`PASSED_MEMO_SIZE` passing reports by preflight key (failures are never kept)."""

    def __init__(self, size: int = PASSED_MEMO_SIZE) -> None:
        self.size = size
        self._reports: OrderedDict[Hashable, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable | None) -> dict[str, Any] | None:
        if key is None:
            return None
        with self._lock:
            report = self._reports.get(key)
            if report is not None:
                self._reports.move_to_end(key)
        return copy.deepcopy(report) if report is not None else None

    def put(self, key: Hashable | None, report: dict[str, Any]) -> None:
        if key is None:
            return
        with self._lock:
            self._reports[key] = copy.deepcopy(report)
            while len(self._reports) > self.size:
                self._reports.popitem(last=False)


# One per API process, like the pool above.
_PASSED = PassedReports()


def run_preflight(
    spec: JobSpec,
    warmed_up: threading.Event | None = None,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    store_root: str | None = None,
) -> dict[str, Any]:
    """The preflight report as a dict; a 422 (SpecError) when a check fails, a 503 past the deadline.

    ``warmed_up`` is the app's warm-up event: importing datasets and transformers here while the
    warm-up thread is still importing them can meet a half-initialised module (an ImportError, a 500),
    so wait for it first, and answer 503 (retry later) rather than import alongside it.
    ``store_root``: the object-store data root, whose data preflight reads (api/paths.store_root).
    """
    if warmed_up is not None and not warmed_up.wait(WARM_UP_WAIT_S):
        raise Problem(
            503,
            f"the API is still loading its data and model libraries after {WARM_UP_WAIT_S:g} s; nothing was "
            "stored, submit again later",
            headers={"Retry-After": "5"},
        )
    from trainer_core.preflight import preflight, preflight_key

    key = preflight_key(spec, store_root)  # before the checks: a file changed meanwhile only misses next time
    remembered = _PASSED.get(key)
    if remembered is not None:
        return remembered
    future = _POOL.submit(preflight, spec, store_root)
    try:
        report = future.result(timeout=timeout_s).as_dict()
    except FutureTimeout as exc:
        raise Problem(
            503,
            f"preflight did not finish reading the data and model within {timeout_s:g} s; nothing was stored, "
            "submit again later",
            headers={"Retry-After": "5"},
        ) from exc
    _PASSED.put(key, report)
    return report
