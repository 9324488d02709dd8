"""A training sampler whose order depends only on (seed, epoch), so a resumed run sees the same batches."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices


class EpochSampler(Sampler[int]):
    """Shuffles each epoch from ``seed + epoch``; with ``lengths``, groups similar lengths together.

    Grouping uses Trainer's own recipe (mega-batches sorted by length) with ``group_size`` equal to the
    samples per optimizer step, so batch 8 x accumulation 2 sees the same 16 samples as batch 16.
    Its own generator keeps the global RNG (dropout) untouched, which resume relies on.
    """

    def __init__(self, num_samples: int, seed: int, group_size: int, lengths: list[int] | None = None) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.group_size = group_size
        self.lengths = lengths
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.lengths is not None:
            order = get_length_grouped_indices(self.lengths, self.group_size, generator=generator)
            return iter([int(i) for i in order])
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())


def eval_order(lengths: list[int] | None, num_samples: int) -> list[int]:
    """Evaluation order: longest first, so each eval batch pads little (metrics ignore order)."""
    if lengths is None:
        return list(range(num_samples))
    return sorted(range(num_samples), key=lambda i: -lengths[i])
