"""Preflight for causal-lm and adapter specs: what can be known before training, as field errors.

* ``adapter.target_modules`` that match no Linear module (read from the model built on the meta
  device, the estimator's structure, so no weights are loaded);
* ``preprocessing.packing`` with a model that cannot separate packed examples;
* chat data (``dataset.messages_column`` present) with a tokenizer that has no chat template.

The run makes the same checks where it meets them (model building, data preparation); these say it
at submit. Sources this machine cannot read (a hub model offline) are left to the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainer_core.spec import FieldError, JobSpec, SpecError

logger = logging.getLogger(__name__)


def check_adapter_targets(spec: JobSpec) -> None:
    """A :class:`SpecError` on ``adapter.target_modules`` when the named modules match nothing."""
    if spec.adapter is None or spec.adapter.target_modules == "all-linear":
        return
    from trainer_core.memory.adapters import target_linears
    from trainer_core.memory.parameters import model_structure

    target_linears(model_structure(spec.model, spec.task), spec.adapter)


def _check_packing(spec: JobSpec) -> None:
    from trainer_core.data.lm_prepare import check_lm_model, lm_model_config
    from trainer_core.modeling import config_from_dict

    config = config_from_dict(spec.model.config) if spec.model.config is not None else None
    check_lm_model(spec, lm_model_config(spec, config))


def _check_chat_template(spec: JobSpec, columns: list[str]) -> None:
    from trainer_core.data.causal_lm import check_chat_tokenizer
    from trainer_core.data.loading import lm_shape
    from trainer_core.data.text import load_tokenizer, tokenizer_source

    if spec.is_preference:  # its own columns and check: trainer_core.data.preference.count_truncation
        return
    if not columns or tokenizer_source(spec) is None or lm_shape(spec.dataset, columns) != "chat":
        return
    try:
        tokenizer = load_tokenizer(spec)
    except (OSError, ValueError) as exc:  # the model source check names an unreadable tokenizer
        logger.info("tokenizer not readable before the run: %s", exc)
        return
    check_chat_tokenizer(tokenizer, spec)


def lm_errors(spec: JobSpec, columns: list[str], checks: list[str]) -> list[FieldError]:
    """Every problem above, as field errors; ``columns`` are the train split's (empty when unread)."""
    errors: list[FieldError] = []
    steps: list[tuple[str, Callable[[], None]]] = [("adapter_targets", lambda: check_adapter_targets(spec))]
    if spec.task == "causal-lm":
        steps += [("lm_model", lambda: _check_packing(spec))]
        steps += [("chat_template", lambda: _check_chat_template(spec, columns))]
    for name, step in steps:
        try:
            step()
        except SpecError as exc:
            errors.extend(exc.errors)
        checks.append(name)
    return errors
