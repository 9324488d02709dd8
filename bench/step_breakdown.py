"""Where a training loop's time goes, measured the same way for any loop (trainjobs' or a Trainer script).

:class:`StepBreakdown` patches, for the duration of a ``with`` block, the calls every PyTorch loop
makes and records each call's wall time (``perf_counter``) and CPU time (``process_time``, all threads
of this process: on a machine shared with other work, it counts this process's own work only):

- ``data``: ``next()`` on a DataLoader iterator (sampling, reading rows, collating);
- ``forward``: the model class's ``forward`` while gradients are enabled (evaluation is not counted);
- ``backward``: ``Tensor.backward``;
- ``optimizer``: ``Optimizer.step`` (through torch's global step hooks), ``zero_grad`` and gradient clipping;
- ``checkpoint``: ``Accelerator.save_state`` and ``Trainer._save_checkpoint``.

It also counts the ``input_ids`` elements the training forwards see, padding included: what forward
and backward cost grows with, so two loops over the same data can be told apart by their batching.

The training window runs from the first batch fetched to the end of the last optimizer step or
checkpoint; ``other`` is the window minus those parts: the loop's own per-step work (events,
scheduler, callbacks, moving batches, accelerate's wrappers). Calls outside the window (the
evaluation after training) are left out.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PARTS = ("data", "forward", "backward", "optimizer", "checkpoint")


@dataclass
class _Call:
    part: str
    start: float  # perf_counter at entry
    wall: float
    cpu_start: float  # process_time at entry
    cpu: float


@dataclass
class StepBreakdown:
    """Record the parts of training steps while active; :meth:`report` sums them per optimizer step."""

    model_cls: type
    calls: list[_Call] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0  # input_ids elements (padding included) through training forwards
    _depth: int = 0  # nested timed calls (clipping inside an accelerate wrapper) count once
    _undo: list[Callable[[], None]] = field(default_factory=list)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        if self._depth:
            yield
            return
        self._depth += 1
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._depth -= 1
            self.calls.append(_Call(part, w0, time.perf_counter() - w0, c0, time.process_time() - c0))

    def _wrap(self, owner: Any, name: str, part: str, when: Callable[[], bool] = lambda: True) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)  # Trainer reads the model forward's signature through it
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not when():
                return original(*args, **kwargs)
            if part == "forward" and (ids := kwargs.get("input_ids")) is not None:
                self.tokens += int(ids.numel())
            with self.timed(part):
                return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> StepBreakdown:
        import torch
        from accelerate import Accelerator
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data.dataloader import _BaseDataLoaderIter
        from transformers import Trainer

        self._wrap(_BaseDataLoaderIter, "__next__", "data")
        self._wrap(self.model_cls, "forward", "forward", torch.is_grad_enabled)
        self._wrap(torch.Tensor, "backward", "backward")
        self._wrap(torch.optim.Optimizer, "zero_grad", "optimizer")
        self._wrap(torch.nn.utils, "clip_grad_norm_", "optimizer")
        self._wrap(Accelerator, "save_state", "checkpoint")
        self._wrap(Trainer, "_save_checkpoint", "checkpoint")
        starts: list[tuple[float, float]] = []

        def pre(*_: Any) -> None:
            starts.append((time.perf_counter(), time.process_time()))

        def post(*_: Any) -> None:
            w0, c0 = starts.pop()
            self.steps += 1
            self.calls.append(_Call("optimizer", w0, time.perf_counter() - w0, c0, time.process_time() - c0))

        for handle in (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)):
            self._undo.append(handle.remove)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def report(self) -> dict[str, Any]:
        """Per optimizer step: each part's wall and CPU ms, ``other`` and ``total``, over the window."""
        closing = [c for c in self.calls if c.part in ("optimizer", "checkpoint")]
        fetches = [c for c in self.calls if c.part == "data"]
        if not closing or not fetches or not self.steps:
            return {}
        first = min(fetches, key=lambda c: c.start)
        last = max(closing, key=lambda c: c.start + c.wall)
        begin, end = first.start, last.start + last.wall
        inside = [c for c in self.calls if begin <= c.start < end]
        window_cpu = last.cpu_start + last.cpu - first.cpu_start
        out: dict[str, Any] = {"steps": self.steps, "tokens_per_step": self.tokens / self.steps}
        for part in PARTS:
            chosen = [c for c in inside if c.part == part]
            out[part] = {"wall_ms": 1e3 * sum(c.wall for c in chosen) / self.steps,
                         "cpu_ms": 1e3 * sum(c.cpu for c in chosen) / self.steps}  # fmt: skip
        total = {"wall_ms": 1e3 * (end - begin) / self.steps, "cpu_ms": 1e3 * window_cpu / self.steps}
        out["other"] = {k: total[k] - sum(out[p][k] for p in PARTS) for k in total}
        out["total"] = total
        return out
