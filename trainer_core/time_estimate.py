"""How long a run will take: its counted FLOPs (:mod:`trainer_core.flops`) over a device's rate, the
rate learned from the queue's own finished jobs (issue 29).

``rate = peak(device, dtype) x efficiency``. The peak is the device's published dense figure
(:data:`DEVICES`, with sources); the efficiency (the model FLOPs utilisation, MFU) is what a queue's
jobs really reach, which depends on the model size, the kernels, the data loader and the host far
more than any table could say. So it is learned: each finished job gives one ``efficiency = counted
FLOPs / (seconds x peak)``, and :func:`calibrate` fits the recent ones robustly (the median of their
logarithms, the spread from the median absolute deviation, so one odd job does not move it).

The answer is a range, p10-p90 of a new job's time: ``exp(median ± t x spread x sqrt(1 + 1/n))``
(a prediction interval, Student's t with ``n - 1`` degrees of freedom), so it narrows as the history
grows, and the spread is pooled with the prior's (:data:`PRIOR_WEIGHT`) so a handful of similar
jobs cannot claim certainty. Before :data:`MIN_JOBS` jobs the prior :data:`PRIOR_EFFICIENCY` is used
with the wide :data:`PRIOR_SPREAD`, and the answer says it is uncalibrated.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Dtype = Literal["fp32", "tf32", "bf16", "fp16"]


@dataclass(frozen=True)
class Device:
    """A device's published peak dense matrix throughput, in FLOP/s per dtype, and its memory bandwidth."""

    name: str
    peak: dict[str, float]
    bandwidth_gbs: float
    source: str


T = 1e12
# Dense (no 2:4 sparsity) peaks from the vendors' data sheets.
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "H100-SXM",
            {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
            3350,
            "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 column, dense = half the sparse figure",
        ),
        Device(
            "H100-PCIe",
            {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T},
            2000,
            "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe column",
        ),
        Device(
            "H200",
            {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
            4800,
            "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column",
        ),
        Device(
            "A100-80GB",
            {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
            2039,
            "NVIDIA A100 Tensor Core GPU datasheet (2021), 80GB SXM column",
        ),
        Device(
            "A100-40GB",
            {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
            1555,
            "NVIDIA A100 Tensor Core GPU datasheet (2021), 40GB SXM column",
        ),
        Device(
            "L40S",
            {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T, "fp16": 362 * T},
            864,
            "NVIDIA L40S datasheet (2023)",
        ),
        Device(
            "L4",
            {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T},
            300,
            "NVIDIA L4 Tensor Core GPU datasheet (2023)",
        ),
        Device(
            "A10G",
            {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},
            600,
            "NVIDIA A10 Tensor Core GPU datasheet (2021); AWS A10G as A10",
        ),
        Device("T4", {"fp32": 8.1 * T, "fp16": 65 * T}, 320, "NVIDIA T4 Tensor Core GPU datasheet (2019)"),
        # A nominal figure, not a measurement: a CPU's rate varies with its cores, clock and vector units
        # too much for a table, so its queue's efficiency (learned) carries the difference.
        Device("cpu", {"fp32": 0.1 * T, "bf16": 0.1 * T}, 50, "nominal (100 GFLOP/s); learned efficiency corrects it"),
    )
}
MIN_JOBS = 3  # finished jobs before a queue's own efficiency is used
HISTORY = 50  # the newest finished jobs a fit reads
# Before any history: a typical MFU of fine-tuning with transformers on a GPU (30-40% for large models,
# less for small ones), and a spread that makes p10-p90 about x/÷ 3: honest about knowing little.
PRIOR_EFFICIENCY = 0.3
PRIOR_SPREAD = math.log(3) / 1.2816  # so that p90 / median = 3 (z 0.9 = 1.2816)
PRIOR_WEIGHT = 1  # how many jobs' worth of spread the prior's counts for, once there is history
# Student's t, 0.9 quantile, by degrees of freedom (the normal's 1.2816 beyond the table).
_T90 = {1: 3.078, 2: 1.886, 3: 1.638, 4: 1.533, 5: 1.476, 6: 1.440, 7: 1.415, 8: 1.397, 9: 1.383, 10: 1.372,
        12: 1.356, 15: 1.341, 20: 1.325, 30: 1.310, 60: 1.296}  # fmt: skip


def t90(dof: int) -> float:
    """The 0.9 quantile of Student's t with ``dof`` degrees of freedom (the nearest tabled value at or
    below ``dof``, which errs wide)."""
    if dof >= 120:
        return 1.2816
    return _T90[max(k for k in _T90 if k <= max(dof, 1))]


def device_peak(device: str, dtype: Dtype) -> float:
    """The device's peak FLOP/s at ``dtype`` (tf32 falls back to fp32, fp16 to bf16 where not listed)."""
    try:
        entry = DEVICES[device]
    except KeyError:
        raise ValueError(f"unknown device {device!r}; known: {', '.join(DEVICES)}") from None
    for name in (dtype, {"tf32": "fp32", "fp16": "bf16", "bf16": "fp16"}.get(dtype, dtype)):
        if name in entry.peak:
            return entry.peak[name]
    raise ValueError(f"{device} has no published {dtype} figure")


@dataclass(frozen=True)
class Observation:
    """One finished job: the FLOPs its run was counted to do, and the seconds it trained."""

    flops: float
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """A queue's efficiency: the centre and spread of ``log(efficiency)``, from ``jobs`` finished jobs."""

    log_efficiency: float
    spread: float
    jobs: int
    calibrated: bool

    @property
    def efficiency(self) -> float:
        return math.exp(self.log_efficiency)

    def factor_range(self) -> tuple[float, float]:
        """Multipliers of the median time that give p10 and p90 (a prediction interval)."""
        if not self.calibrated:
            width = 1.2816 * self.spread
        else:
            width = t90(self.jobs - 1) * self.spread * math.sqrt(1 + 1 / self.jobs)
        return math.exp(-width), math.exp(width)


def calibrate(history: Sequence[Observation], peak: float) -> Calibration:
    """Fit a queue's efficiency from its newest :data:`HISTORY` finished jobs (oldest first)."""
    usable = [o for o in history[-HISTORY:] if o.flops > 0 and o.seconds > 0]
    if len(usable) < MIN_JOBS:
        return Calibration(math.log(PRIOR_EFFICIENCY), PRIOR_SPREAD, len(usable), calibrated=False)
    logs = [math.log(o.flops / (o.seconds * peak)) for o in usable]
    centre = statistics.median(logs)
    # 1.4826 x MAD estimates a normal's sigma. A few jobs' spread is itself uncertain (3 similar jobs
    # would claim certainty), so it is pooled with the prior's as if the prior were PRIOR_WEIGHT jobs.
    seen = 1.4826 * statistics.median(abs(x - centre) for x in logs)
    dof = len(usable) - 1
    spread = math.sqrt((PRIOR_WEIGHT * PRIOR_SPREAD**2 + dof * seen**2) / (PRIOR_WEIGHT + dof))
    return Calibration(centre, spread, len(usable), calibrated=True)


@dataclass(frozen=True)
class TimePrediction:
    seconds: float  # the median prediction
    low: float  # p10
    high: float  # p90
    calibration: Calibration


def predict_seconds(flops: float, peak: float, calibration: Calibration) -> TimePrediction:
    """Seconds to do ``flops`` of work on a device of ``peak`` FLOP/s at the calibrated efficiency."""
    seconds = flops / (peak * calibration.efficiency)
    low, high = calibration.factor_range()
    return TimePrediction(seconds, seconds * low, seconds * high, calibration)
