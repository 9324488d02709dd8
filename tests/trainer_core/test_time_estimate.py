"""The time model of trainer_core/time_estimate.py: device peaks, the efficiency learned from a synthetic
history, and a range that narrows as the history grows (issue 29)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from trainer_core.time_estimate import (
    MIN_JOBS,
    PRIOR_EFFICIENCY,
    Observation,
    calibrate,
    device_peak,
    predict_seconds,
)

PEAK = device_peak("A100-80GB", "bf16")


def history(n: int, efficiency: float, scatter: float, seed: int = 0) -> list[Observation]:
    """``n`` finished jobs of varied size whose efficiency is ``efficiency`` x/÷ a log-normal scatter."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        flops = 10 ** rng.uniform(15, 18)
        reached = efficiency * math.exp(rng.gauss(0, scatter))
        jobs.append(Observation(flops, flops / (PEAK * reached)))
    return jobs


def test_published_peaks_and_their_fallbacks() -> None:
    assert device_peak("H100-SXM", "bf16") == pytest.approx(989.4e12)
    assert device_peak("A100-80GB", "fp32") == pytest.approx(19.5e12)
    assert device_peak("T4", "bf16") == device_peak("T4", "fp16")  # listed as fp16 only
    assert device_peak("T4", "tf32") == device_peak("T4", "fp32")
    with pytest.raises(ValueError, match="unknown device 'B9000'"):
        device_peak("B9000", "bf16")


def test_without_enough_history_the_prior_is_used_and_said() -> None:
    few = calibrate(history(MIN_JOBS - 1, 0.05, 0.1), PEAK)
    assert not few.calibrated and few.efficiency == pytest.approx(PRIOR_EFFICIENCY)
    low, high = few.factor_range()
    assert low == pytest.approx(1 / 3) and high == pytest.approx(3)  # x/÷ 3: it knows little


def test_the_efficiency_is_learned_from_the_queues_jobs_and_one_odd_job_does_not_move_it() -> None:
    jobs = history(20, 0.12, 0.05)
    fit = calibrate(jobs, PEAK)
    assert fit.calibrated and fit.jobs == 20
    assert fit.efficiency == pytest.approx(0.12, rel=0.05)
    odd = Observation(1e17, 1e17 / (PEAK * 0.001))  # a job 100x slower (a stalled data loader, say)
    assert calibrate([*jobs, odd], PEAK).efficiency == pytest.approx(fit.efficiency, rel=0.03)
    # A new job of 1e18 FLOPs: its time is work over the learned rate, and its range holds the truth.
    predicted = predict_seconds(1e18, PEAK, fit)
    truth = 1e18 / (PEAK * 0.12)
    assert predicted.seconds == pytest.approx(truth, rel=0.05)
    assert predicted.low < truth < predicted.high


def test_the_range_narrows_as_the_history_grows() -> None:
    widths = [calibrate(history(n, 0.2, 0.15, seed=n), PEAK).factor_range() for n in (3, 6, 12, 40)]
    ratios = [high / low for low, high in widths]
    assert all(later < earlier for earlier, later in itertools.pairwise(ratios)), ratios
    assert ratios[-1] < 1.8  # 40 jobs scattered x/÷ 1.16: about what they show


def test_the_range_covers_at_least_80_percent_of_new_jobs_without_being_vague() -> None:
    fit = calibrate(history(40, 0.2, 0.15), PEAK)
    new = history(2000, 0.2, 0.15, seed=99)
    inside = 0
    for job in new:
        p = predict_seconds(job.flops, PEAK, fit)
        inside += p.low <= job.seconds <= p.high
    assert 0.8 <= inside / len(new) < 0.97, inside  # the pooled prior errs wide, a little


def stepped_history(n: int, overhead: float, efficiency: float, scatter: float, seed: int = 0) -> list[Observation]:
    """``n`` jobs of 50-500 steps and 1e12-1e15 FLOPs a step: ``steps x overhead + FLOPs / rate``."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        steps = rng.randint(50, 500)
        flops = steps * 10 ** rng.uniform(12, 15)
        seconds = (steps * overhead + flops / (PEAK * efficiency)) * math.exp(rng.gauss(0, scatter))
        jobs.append(Observation(flops, seconds, steps=steps))
    return jobs


def test_a_per_step_overhead_and_the_rate_are_told_apart() -> None:
    jobs = stepped_history(12, overhead=0.02, efficiency=0.3, scatter=0.02)
    fit = calibrate(jobs, PEAK)
    assert fit.overhead_s == pytest.approx(0.02, rel=0.1) and fit.efficiency == pytest.approx(0.3, rel=0.1)
    # A small model, where the overhead is most of the time: the one-term fit would be far off.
    steps, flops = 300, 300 * 1e12
    truth = steps * 0.02 + flops / (PEAK * 0.3)
    assert predict_seconds(flops, PEAK, fit, steps=steps).seconds == pytest.approx(truth, rel=0.05)
    one_term = calibrate([Observation(o.flops, o.seconds) for o in jobs], PEAK)  # steps unknown
    assert one_term.overhead_s == 0.0
    assert abs(predict_seconds(flops, PEAK, one_term).seconds / truth - 1) > 0.3
    # One stalled job (10x slower) moves neither term much.
    stalled = Observation(jobs[0].flops, jobs[0].seconds * 10, steps=jobs[0].steps)
    refit = calibrate([*jobs, stalled], PEAK)
    assert refit.overhead_s == pytest.approx(0.02, rel=0.15) and refit.efficiency == pytest.approx(0.3, rel=0.15)


def test_jobs_of_one_work_per_step_keep_the_one_term_fit() -> None:
    # Steps and FLOPs move together: an overhead could not be told from a slower rate.
    jobs = [Observation(steps * 1e13, steps * (0.01 + 1e13 / (PEAK * 0.2)), steps=steps) for steps in (40, 90, 300)]
    fit = calibrate(jobs, PEAK)
    assert fit.calibrated and fit.overhead_s == 0.0
    truth = 120 * (0.01 + 1e13 / (PEAK * 0.2))
    assert predict_seconds(120 * 1e13, PEAK, fit, steps=120).seconds == pytest.approx(truth)
