"""How many tokens a training sample really has, from the data's own lengths (the time estimate's ``s``).

The FLOP count (trainer_core/flops.py) needs the positions a sample occupies after padding or packing.
Without the data it assumes ``max_length``; with rows (preflight's head of the training split) it takes
the lengths the run's own encoders give, truncated at the run's ``max_length``, and batches them as
the run does:

- **padding** pads each micro-batch to its longest row. With ``group_by_length`` the run sorts
  mega-batches of :data:`~trainer_core.backends.sampling.MEGA_BATCH_STEPS` steps by length and cuts
  them into micro-batches (simulated here on the rows, with the run's rule); without it a micro-batch
  is ``B`` rows drawn at random, whose longest has the order-statistics expectation
  ``sum_k L(k) x ((k/n)^B - ((k-1)/n)^B)`` over the sorted lengths ``L``.
- **preference pairs** (``method`` dpo/orpo): a sample is its chosen and its rejected sequence, two
  rows of the batch padded alike, so its length is twice the longer one (``max_length`` caps each).
- **packing** (causal-LM) packs the rows read as the run does (best-fit decreasing,
  trainer_core/data/packing.py): a sample is a packed row, ``samples_per_row`` is packed rows over rows
  read, and the packed rows are batched and padded as above (eager and SDPA keep a batch as ``B`` rows
  padded to the longest; flash attention's flattened batch has no padding, so this bounds it).

Text tasks with a named tokenizer only: a config-built model without one trains its tokenizer on the
data when it runs, and image and audio samples have fixed sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer_core.spec import JobSpec

MEGA_BATCH_STEPS = 50  # trainer_core/backends/sampling.py's (not imported: it loads torch); a test pins them


@dataclass(frozen=True)
class SampleTokens:
    """Positions per training sample, and training samples per data row (below 1 when rows are packed)."""

    tokens: float
    samples_per_row: float
    rows_measured: int

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "samples_per_row": self.samples_per_row, "rows_measured": self.rows_measured}


def measured_lengths(spec: JobSpec, rows: Any) -> list[int] | None:
    """Token counts of ``rows`` (a ``datasets.Dataset``) as the run encodes them; None where the run's
    tokenizer is not a saved one, or for image and audio tasks."""
    from trainer_core.data.preprocess import effective_max_length
    from trainer_core.data.text import load_tokenizer, tokenizer_source

    if spec.task not in ("text-classification", "causal-lm") or tokenizer_source(spec) is None or not len(rows):
        return None
    tokenizer = load_tokenizer(spec)
    max_length = effective_max_length(spec, tokenizer)
    if spec.is_preference:
        from trainer_core.data.preference import make_preference_encoder

        encoded_pairs = make_preference_encoder(spec, tokenizer, max_length).pairs(rows[:])
        # A pair is two rows of the batch, each padded to the longest: twice its longer sequence.
        return [2 * max(len(p.chosen_ids), len(p.rejected_ids)) for p in encoded_pairs if p.trainable]
    if spec.task == "causal-lm":
        from trainer_core.data.causal_lm import has_targets, make_lm_encoder
        from trainer_core.data.loading import lm_shape

        encoder = make_lm_encoder(spec, tokenizer, lm_shape(spec.dataset, rows.column_names), max_length)
        encoded = encoder(rows[:])
        keep = [has_targets({"labels": labels}) for labels in encoded["labels"]]  # as drop_untrainable does
        return [len(ids) for ids, kept in zip(encoded["input_ids"], keep, strict=True) if kept]
    ds = spec.dataset
    texts = [str(t) for t in rows[ds.text_column]]
    pairs = [str(t) for t in rows[ds.text_pair_column]] if ds.text_pair_column else None
    encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
    return [len(ids) for ids in encoded["input_ids"]]


def _grouped_padding(lengths: list[int], batch: int, group: int) -> float:
    """Mean padded micro-batch length under length grouping: each mega-batch of the rows sorted and
    cut into groups of ``group`` samples, each micro-batch of ``batch`` padded to its longest."""
    mega = group * MEGA_BATCH_STEPS
    padded: list[int] = []
    for start in range(0, len(lengths), mega):
        chunk = sorted(lengths[start : start + mega], reverse=True)
        padded += [chunk[k] for k in range(0, len(chunk), batch) for _ in chunk[k : k + batch]]
    return sum(padded) / len(padded)


def _random_padding(lengths: list[int], batch: int) -> float:
    """E[the longest of ``batch`` rows drawn at random], from the sorted lengths' order statistics."""
    ordered, n = sorted(lengths), len(lengths)
    return sum(length * ((k / n) ** batch - ((k - 1) / n) ** batch) for k, length in enumerate(ordered, start=1))


def sample_tokens(spec: JobSpec, lengths: list[int]) -> SampleTokens:
    """Positions per sample and samples per row of a run of ``spec`` on rows of these ``lengths``."""
    # A preference sample is two sequences of at most max_length each.
    limit = spec.preprocessing.max_length * (2 if spec.is_preference else 1)
    lengths = [min(length, limit) for length in lengths if length > 0]
    if not lengths:
        return SampleTokens(float(limit), 1.0, 0)
    samples = lengths
    if spec.task == "causal-lm" and spec.preprocessing.packing:
        from trainer_core.data.packing import best_fit_rows

        samples = [sum(lengths[i] for i in row) for row in best_fit_rows(lengths, limit)]
    batch = spec.training.per_device_train_batch_size
    if spec.preprocessing.group_by_length:
        group = batch * spec.efficiency.gradient_accumulation_steps
        tokens = _grouped_padding(samples, batch, group)
    else:
        tokens = _random_padding(samples, batch)
    return SampleTokens(tokens, len(samples) / len(lengths), len(lengths))


def estimate_sample_tokens(spec: JobSpec, rows: Any) -> SampleTokens | None:
    """:func:`sample_tokens` over ``rows`` as the run would encode them; None where they cannot be measured."""
    lengths = measured_lengths(spec, rows)
    return sample_tokens(spec, lengths) if lengths else None
