"""Metrics against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_core.metrics import compute_metrics

ALL = ["accuracy", "f1", "precision", "recall"]


def test_binary_scores_the_positive_class() -> None:
    refs = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    preds = np.array([1, 1, 1, 0, 1, 1, 0, 0, 0, 0])
    # positive class: tp=3, fp=2, fn=1 -> precision 3/5, recall 3/4, f1 = 2pr/(p+r) = 2/3
    scores = compute_metrics(ALL, preds, refs, num_labels=2)
    assert scores == pytest.approx({"accuracy": 0.7, "precision": 0.6, "recall": 0.75, "f1": 2 / 3})


def test_multiclass_is_the_macro_average() -> None:
    refs = np.array([0, 0, 0, 1, 1, 2])
    preds = np.array([0, 0, 1, 1, 2, 2])
    # class 0: p=2/2 r=2/3 f1=0.8; class 1: p=1/2 r=1/2 f1=0.5; class 2: p=1/2 r=1 f1=2/3
    scores = compute_metrics(ALL, preds, refs, num_labels=3)
    assert scores["accuracy"] == pytest.approx(4 / 6)
    assert scores["precision"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert scores["recall"] == pytest.approx((2 / 3 + 0.5 + 1) / 3)
    assert scores["f1"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)


def test_logits_are_argmaxed_and_only_named_metrics_returned() -> None:
    logits = np.array([[2.0, 0.1, 0.0], [0.0, 0.2, 3.0], [0.0, 1.0, 0.5]])
    assert compute_metrics(["accuracy"], logits, np.array([0, 2, 0]), num_labels=3) == {
        "accuracy": pytest.approx(2 / 3)
    }


def test_never_predicted_positive_scores_zero_not_nan() -> None:
    scores = compute_metrics(ALL, np.array([0, 0, 0]), np.array([1, 0, 0]), num_labels=2)
    assert scores == pytest.approx({"accuracy": 2 / 3, "precision": 0.0, "recall": 0.0, "f1": 0.0})


def test_label_absent_from_both_does_not_dilute_macro() -> None:
    # Label 3 of 4 never occurs: averaged over labels 0-2 only, like scikit-learn.
    scores = compute_metrics(["recall"], np.array([0, 1, 2]), np.array([0, 1, 1]), num_labels=4)
    assert scores["recall"] == pytest.approx((1 + 0.5 + 0) / 3)


@pytest.mark.parametrize(
    ("names", "preds", "refs", "message"),
    [
        (["auc"], [0], [0], "unknown metric"),
        (["accuracy"], [0, 1], [0], "2 predictions for 1 references"),
        (["accuracy"], [], [], "empty"),
    ],
)
def test_bad_input_is_rejected(names: list[str], preds: list[int], refs: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_metrics(names, np.array(preds), np.array(refs), num_labels=2)
