"""Graceful stop: SIGTERM or a stop file asks a run to finish its current step, checkpoint and exit.

The signal handler only sets a flag; the training loop polls :meth:`StopSignal.requested` after each
optimizer step, so a stop never interrupts a step half-way and the checkpoint it writes is consistent.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

logger = logging.getLogger(__name__)


class StopSignal:
    """Watches SIGTERM (main thread only) and an optional stop file; use as a context manager."""

    def __init__(self, stop_file: Path | None = None) -> None:
        self.stop_file = stop_file
        self._signalled = False
        self._previous: Any = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        logger.info("SIGTERM received: stopping after the current step")
        self._signalled = True

    def __enter__(self) -> StopSignal:
        # signal.signal only works on the main thread; elsewhere (a library caller's worker thread)
        # the stop file is the way to stop.
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def requested(self) -> bool:
        """True once SIGTERM arrived or the stop file exists (checked locally, no collective)."""
        if not self._signalled and self.stop_file is not None and self.stop_file.exists():
            logger.info("stop file %s found: stopping after the current step", self.stop_file)
            self._signalled = True
        return self._signalled

    def requested_by_any(self, device: torch.device) -> bool:
        """Like :meth:`requested`, agreed across processes so every rank stops at the same step.

        Under several processes the signal may reach ranks at different steps; a rank that stopped
        alone would leave the others waiting in a collective forever. A single-process run pays nothing.
        """
        local = self.requested()
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return local
        flag = torch.tensor([1 if local else 0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
