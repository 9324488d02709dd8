"""Preflight for causal-lm and adapter specs: what can be known before training, as field errors.

* ``adapter.target_modules`` that match no Linear module (read from the model built on the meta
  device, the estimator's structure, so no weights are loaded);
* ``preprocessing.packing`` with a model that cannot separate packed examples;
* chat data (``dataset.messages_column`` present) with a tokenizer that has no chat template;
* ``efficiency.chunked_loss`` with a model that changes its logits after the head (Gemma 2's soft cap).

The run makes the same checks where it meets them (model building, data preparation); these say it
at submit. Sources this machine cannot read (a hub model offline) are left to the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainer_core.spec import FieldError, JobSpec, SpecError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def check_adapter_targets(spec: JobSpec) -> None:
    """A :class:`SpecError` on ``adapter.target_modules`` when the named modules match nothing."""
    if spec.adapter is None or spec.adapter.target_modules == "all-linear":
        return
    from trainer_core.memory.adapters import target_linears
    from trainer_core.memory.parameters import model_structure

    target_linears(model_structure(spec.model, spec.task), spec.adapter)


def _model_config(spec: JobSpec) -> PreTrainedConfig | None:
    """The causal LM's config, as the run reads it (None where a pretrained one is unreadable here)."""
    from trainer_core.data.lm_prepare import lm_model_config
    from trainer_core.modeling import config_from_dict

    return lm_model_config(spec, config_from_dict(spec.model.config) if spec.model.config is not None else None)


def readable_tokenizer(spec: JobSpec) -> PreTrainedTokenizerBase | None:
    """The spec's named tokenizer, or None where there is none or it cannot be read here (the model
    source check names an unreadable one; a config-built model's is trained by the run)."""
    from trainer_core.data.text import load_tokenizer, tokenizer_source

    if tokenizer_source(spec) is None:
        return None
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        logger.info("tokenizer not readable before the run: %s", exc)
        return None


def _check_chat_template(spec: JobSpec, columns: list[str]) -> None:
    from trainer_core.data.causal_lm import check_chat_tokenizer
    from trainer_core.data.loading import lm_shape

    if spec.is_preference:  # its own columns and check: trainer_core.preflight's pairs check
        return
    if not columns or lm_shape(spec.dataset, columns) != "chat":
        return
    if (tokenizer := readable_tokenizer(spec)) is not None:
        check_chat_tokenizer(tokenizer, spec)


def _check_chunked_loss(spec: JobSpec, config: PreTrainedConfig | None) -> None:
    """``efficiency.chunked_loss`` on a model whose config changes the logits after the head."""
    if not spec.efficiency.chunked_loss or config is None:
        return
    from trainer_core.chunked_loss import CHUNKED_REFUSAL, changes_logits

    if (field := changes_logits(config)) is not None:
        raise SpecError([FieldError("efficiency.chunked_loss", f"{CHUNKED_REFUSAL} (its config sets {field})")])


def lm_errors(spec: JobSpec, columns: list[str], checks: list[str]) -> list[FieldError]:
    """Every problem above, as field errors; ``columns`` are the train split's (empty when unread)."""
    errors: list[FieldError] = []
    steps: list[tuple[str, Callable[[], None]]] = [("adapter_targets", lambda: check_adapter_targets(spec))]
    if spec.task == "causal-lm":
        from trainer_core.data.lm_prepare import check_lm_model

        config = _model_config(spec)  # read once, for both checks
        steps += [("lm_model", lambda: check_lm_model(spec, config))]
        steps += [("chat_template", lambda: _check_chat_template(spec, columns))]
        steps += [("chunked_loss", lambda: _check_chunked_loss(spec, config))]
    for name, step in steps:
        try:
            step()
        except SpecError as exc:
            errors.extend(exc.errors)
        checks.append(name)
    return errors
