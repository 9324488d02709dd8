"""Why a run failed, in the service's vocabulary, and a one-line message a person can act on.

``trainer_core`` cannot import ``service_core``, so :data:`FailureReason` lists the values of
``service_core.status.ErrorReason`` that a run itself can report; a test keeps them in step. The
traceback is logged by the caller (``logger.exception``); the summary carries only the message.
"""

from __future__ import annotations

import traceback
from typing import Any, Literal, get_args

import torch

from trainer_core.deadline import RunTimeoutError
from trainer_core.nan_guard import NanLossError
from trainer_core.spec import SpecError

FailureReason = Literal[
    "invalid_spec", "data_error", "model_error", "out_of_memory", "nan_loss", "timeout", "internal"
]
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)
# Spec-error field prefixes -> the reason their failure stands for.
_FIELD_REASONS: tuple[tuple[str, FailureReason], ...] = (("dataset.", "data_error"), ("model.", "model_error"))
# Functions whose failure is the model's (or its tokenizer's/processor's) rather than the data's.
_MODEL_FUNCTIONS = frozenset({
    "build_model", "resolve_config", "build_training_model", "load_tokenizer", "load_image_processor",
    "load_feature_extractor", "load_processor", "load_saved_processor",
})  # fmt: skip
_MESSAGE_LIMIT = 300


def _frames(exc: BaseException) -> list[tuple[str, str]]:
    """(module, function) of every frame the exception passed through, outermost first."""
    walked = traceback.walk_tb(exc.__traceback__)
    return [(frame.f_globals.get("__name__", ""), frame.f_code.co_name) for frame, _ in walked]


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def failure_reason(exc: BaseException) -> FailureReason:
    """The cause of a failed run: the spec, the data, the model, memory, a diverged loss, or internal."""
    if isinstance(exc, NanLossError):
        return "nan_loss"
    if isinstance(exc, RunTimeoutError):
        return "timeout"
    if is_out_of_memory(exc):
        return "out_of_memory"
    if isinstance(exc, SpecError):
        field = exc.errors[0].field if exc.errors else ""
        return next((reason for prefix, reason in _FIELD_REASONS if field.startswith(prefix)), "invalid_spec")
    frames = _frames(exc)
    if any(module.startswith("trainer_core.") and name in _MODEL_FUNCTIONS for module, name in frames):
        return "model_error"
    if any(module.startswith("trainer_core.data") for module, _ in frames):
        return "data_error"
    return "internal"


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain: libraries wrap the telling error in a generic one."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= _MESSAGE_LIMIT else line[: _MESSAGE_LIMIT - 3] + "..."


def failure_message(exc: BaseException, reason: FailureReason | None = None) -> str:
    """One line saying what went wrong and what to change; never a bare library exception."""
    reason = reason or failure_reason(exc)
    if isinstance(exc, SpecError):
        return "; ".join(f"{e.field}: {e.message}" for e in exc.errors) or str(exc)
    root = root_cause(exc)
    cause = f"{type(root).__name__}: {_first_line(root)}"
    if reason == "timeout":
        return f"{exc}; raise the limit, or shorten the run (training.max_steps, num_train_epochs)"
    if reason == "nan_loss":
        return f"{exc}; lower training.learning_rate, keep training.max_grad_norm > 0, or check the data for bad values"
    if reason == "out_of_memory":
        return (f"out of memory ({cause}); lower training.per_device_train_batch_size, or turn on "
                "efficiency.gradient_checkpointing (`trainjobs estimate` shows configurations that fit)")  # fmt: skip
    if reason == "model_error":
        return (f"the model, tokenizer or processor could not be loaded or built ({cause}); check model.name_or_path, "
                "model.config, model.tokenizer and model.processor")  # fmt: skip
    if reason == "data_error":
        return f"the dataset could not be prepared ({cause}); check dataset.path, data_files and the columns"
    return f"internal error ({cause}); the run's log has the traceback"


def failure_summary(exc: BaseException) -> dict[str, Any]:
    """The ``done`` event's summary for a failed run: reason, message (as ``error``) and field errors."""
    reason = failure_reason(exc)
    summary: dict[str, Any] = {"reason": reason, "error": failure_message(exc, reason)}
    if isinstance(exc, SpecError):
        summary["errors"] = [{"field": e.field, "message": e.message} for e in exc.errors]
    return summary
