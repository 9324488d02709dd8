"""How long a run will take: its counted FLOPs (:mod:`trainer_core.flops`) over a device's rate, the
rate learned from the queue's own finished jobs (issue 29).

``rate = peak(device, dtype) x efficiency``. The peak is the device's published dense figure
(:data:`DEVICES`, with sources); the efficiency (the model FLOPs utilisation, MFU) is what a queue's
jobs really reach, which depends on the model size, the kernels, the data loader and the host far
more than any table could say. So it is learned: each finished job gives one ``efficiency = counted
FLOPs / (seconds x peak)``, and :func:`calibrate` fits the recent ones robustly (the median of their
logarithms, the spread from the median absolute deviation, so one odd job does not move it).

A step also costs time the FLOP count does not see: the data loader, the optimizer step (memory-bound),
kernel launches, the logging. On small models it is most of the step (bench/README: a BERT of 128x2
reached 79 GFLOP/s on the CPU, one of 384x6 153, as a fixed cost per step makes it). So where the
history varies enough in work per step to tell the two apart (:data:`MIN_WORK_RATIO`), the fit has
two terms, ``seconds = steps x overhead + FLOPs / (peak x efficiency)``: a least-squares fit in
relative error, refitted once without the jobs whose residual is far from the rest (a stalled data
loader), with the overhead clamped at 0. Otherwise it is the one-term fit above.

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


# The two-term fit needs jobs whose work per step differs by at least this factor (largest over
# smallest), or steps and FLOPs move together and the overhead cannot be told from the rate.
MIN_WORK_RATIO = 2.0
# A job whose log residual is further than this many robust sigmas from the median is left out of
# the refit (it still counts in the spread: the range must stay honest about such jobs).
OUTLIER_SIGMAS = 3.0


@dataclass(frozen=True)
class Observation:
    """One finished job: the FLOPs its run was counted to do, the seconds it trained, and its optimizer
    steps (0 when unknown: such a job informs the one-term fit only)."""

    flops: float
    seconds: float
    steps: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """A queue's rate: the centre and spread of ``log(efficiency)``, from ``jobs`` finished jobs, and
    the seconds each optimizer step costs beyond its FLOPs (0 for the one-term fit)."""

    log_efficiency: float
    spread: float
    jobs: int
    calibrated: bool
    overhead_s: float = 0.0

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


def _pooled_spread(residuals: Sequence[float], fitted: int) -> float:
    """The spread of log residuals: 1.4826 x MAD estimates a normal's sigma. A few jobs' spread is
    itself uncertain (3 similar jobs would claim certainty), so it is pooled with the prior's as if the
    prior were PRIOR_WEIGHT jobs; ``fitted`` parameters use up degrees of freedom."""
    centre = statistics.median(residuals)
    seen = 1.4826 * statistics.median(abs(x - centre) for x in residuals)
    dof = max(len(residuals) - fitted, 1)
    return math.sqrt((PRIOR_WEIGHT * PRIOR_SPREAD**2 + dof * seen**2) / (PRIOR_WEIGHT + dof))


def _two_terms(jobs: Sequence[Observation]) -> tuple[float, float] | None:
    """(overhead seconds a step, seconds a FLOP) minimising the squared relative error of
    ``steps x overhead + FLOPs x k`` against each job's seconds; None when it has no positive rate."""
    # Each job's row divided by its seconds: relative error, so a long job does not outweigh the rest.
    a = [o.steps / o.seconds for o in jobs]
    b = [o.flops / o.seconds for o in jobs]
    saa, sab, sbb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b, strict=True)), sum(y * y for y in b)
    det = saa * sbb - sab * sab
    if det <= 1e-12 * saa * sbb:
        return None
    overhead = (sbb * sum(a) - sab * sum(b)) / det
    per_flop = (saa * sum(b) - sab * sum(a)) / det
    if overhead < 0:  # no measurable overhead: the best rate alone
        overhead, per_flop = 0.0, sum(b) / sbb
    return (overhead, per_flop) if per_flop > 0 else None


def _log_residuals(jobs: Sequence[Observation], overhead: float, per_flop: float) -> list[float]:
    return [math.log(o.seconds / (o.steps * overhead + o.flops * per_flop)) for o in jobs]


def calibrate(history: Sequence[Observation], peak: float) -> Calibration:
    """Fit a queue's rate from its newest :data:`HISTORY` finished jobs (oldest first): two terms
    (overhead a step, efficiency) where the jobs' work per step varies enough, else the efficiency."""
    usable = [o for o in history[-HISTORY:] if o.flops > 0 and o.seconds > 0]
    if len(usable) < MIN_JOBS:
        return Calibration(math.log(PRIOR_EFFICIENCY), PRIOR_SPREAD, len(usable), calibrated=False)
    stepped = [o for o in usable if o.steps > 0]
    work = [o.flops / o.steps for o in stepped]
    if len(stepped) == len(usable) and max(work) >= MIN_WORK_RATIO * min(work):
        fit = _two_terms(usable)
        if fit is not None:
            residuals = _log_residuals(usable, *fit)
            centre = statistics.median(residuals)
            mad = 1.4826 * statistics.median(abs(r - centre) for r in residuals) or 1e-12
            kept = [o for o, r in zip(usable, residuals, strict=True) if abs(r - centre) <= OUTLIER_SIGMAS * mad]
            refit = _two_terms(kept) if len(kept) >= MIN_JOBS and len(kept) < len(usable) else None
            overhead, per_flop = refit or fit
            spread = _pooled_spread(_log_residuals(usable, overhead, per_flop), fitted=2)
            return Calibration(math.log(1 / (per_flop * peak)), spread, len(usable), True, overhead_s=overhead)
    logs = [math.log(o.flops / (o.seconds * peak)) for o in usable]
    return Calibration(statistics.median(logs), _pooled_spread(logs, fitted=1), len(usable), calibrated=True)


@dataclass(frozen=True)
class TimePrediction:
    seconds: float  # the median prediction
    low: float  # p10
    high: float  # p90
    calibration: Calibration


def predict_seconds(flops: float, peak: float, calibration: Calibration, steps: float = 0.0) -> TimePrediction:
    """Seconds to do ``flops`` of work in ``steps`` optimizer steps on a device of ``peak`` FLOP/s at the
    calibrated efficiency and per-step overhead."""
    seconds = steps * calibration.overhead_s + flops / (peak * calibration.efficiency)
    low, high = calibration.factor_range()
    return TimePrediction(seconds, seconds * low, seconds * high, calibration)
