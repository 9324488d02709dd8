"""The two training backends, 🤗 ``Trainer`` and a hand-written ``Accelerator`` loop, behind one call.

Both receive a :class:`RunContext` (spec, prepared data, event sink, stop signal, checkpoint to
resume from) and return a :class:`BackendResult`; :mod:`trainer_core.run` does the rest.
"""

from __future__ import annotations

from trainer_core.backends.context import BackendResult, RunContext

__all__ = ["BACKEND_MODULES", "BackendResult", "RunContext", "run_backend"]

# Each backend's module, by `training.backend`: what a process that will train imports at its start
# (trainer_core/preimport.py); run_backend imports it by name below.
BACKEND_MODULES = {
    "trainer": "trainer_core.backends.trainer_backend",
    "accelerate": "trainer_core.backends.accelerate_backend",
}


def run_backend(ctx: RunContext) -> BackendResult:
    """Train with the backend the spec names."""
    if ctx.spec.training.backend == "trainer":
        from trainer_core.backends.trainer_backend import train_with_trainer

        return train_with_trainer(ctx)
    from trainer_core.backends.accelerate_backend import train_with_accelerate

    return train_with_accelerate(ctx)
