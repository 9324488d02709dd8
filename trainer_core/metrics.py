"""Classification metrics computed with numpy, and a language model's perplexity, identical in both backends.

Binary tasks (two labels) score the positive class, id 1. Multi-class tasks take the macro average
over the labels that occur in the references or the predictions, with 0 for a label whose precision
or recall is undefined; that is what scikit-learn's ``average="macro"`` reports, so numbers match
what users compute by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

METRIC_NAMES: tuple[str, ...] = ("accuracy", "f1", "precision", "recall")


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """Elementwise division that gives 0 where the denominator is 0 (an undefined score)."""
    out = np.zeros_like(numerator, dtype=np.float64)
    np.divide(numerator, denominator, out=out, where=denominator != 0)
    return out


def _per_label_scores(
    predictions: np.ndarray, references: np.ndarray, label_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall and f1 for each label in ``label_ids``."""
    true_pos = np.array([np.sum((predictions == k) & (references == k)) for k in label_ids], dtype=np.float64)
    predicted = np.array([np.sum(predictions == k) for k in label_ids], dtype=np.float64)
    actual = np.array([np.sum(references == k) for k in label_ids], dtype=np.float64)
    precision = _safe_divide(true_pos, predicted)
    recall = _safe_divide(true_pos, actual)
    f1 = _safe_divide(2 * precision * recall, precision + recall)
    return precision, recall, f1


def compute_metrics(
    names: Sequence[str], predictions: np.ndarray, references: np.ndarray, num_labels: int
) -> dict[str, float]:
    """Score ``predictions`` (class ids, or logits of shape ``(n, num_labels)``) against ``references``.

    Returns only the metrics named, keyed without the ``eval_`` prefix the backends add.
    """
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {list(METRIC_NAMES)}")
    preds = np.asarray(predictions)
    refs = np.asarray(references).reshape(-1)
    if preds.ndim == 2:
        preds = preds.argmax(axis=-1)
    preds = preds.reshape(-1)
    if preds.shape != refs.shape:
        raise ValueError(f"{preds.shape[0]} predictions for {refs.shape[0]} references")
    if refs.size == 0:
        raise ValueError("cannot compute metrics on an empty evaluation set")

    if num_labels == 2:
        label_ids = np.array([1])
    else:
        label_ids = np.union1d(np.unique(refs), np.unique(preds))
    precision, recall, f1 = _per_label_scores(preds, refs, label_ids)
    scores = {
        "accuracy": float(np.mean(preds == refs)),
        "precision": float(precision.mean()),
        "recall": float(recall.mean()),
        "f1": float(f1.mean()),
    }
    return {name: scores[name] for name in names}


# exp() of a larger loss overflows a float; such a model's perplexity is reported as infinite.
_MAX_EXP_ARG = 709.0


def language_model_metrics(eval_loss: float) -> dict[str, float]:
    """What a causal LM is scored by besides its loss: perplexity, ``exp`` of the mean token loss.

    Keyed without the ``eval_`` prefix, like :func:`compute_metrics`.
    """
    return {"perplexity": math.exp(eval_loss) if eval_loss < _MAX_EXP_ARG else math.inf}
