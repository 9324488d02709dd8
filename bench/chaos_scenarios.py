"""Chaos scenarios on running jobs: kills (R1), double delivery (R2), cancels (R4), a kill storm (R9).

Each takes a started :class:`bench.chaos_service.Service` with two workers and a trial count, and
returns its table row; a scenario never raises for a misbehaving service, it counts the failure.
"""

from __future__ import annotations

import os
import random
import signal
import time

from sqlalchemy import select

from bench.chaos_checks import TERMINAL, Row, job_facts, job_progress, job_statuses, judge
from bench.chaos_service import GRACE_S, Service, wait_for
from service_core.db import Job
from service_core.db.session import session_scope
from service_core.status import JobStatus
from trainer_core.checkpoint import newest_checkpoint
from worker.paths import run_paths
from worker.procfs import is_alive, parent_of

FINISH_S = 300.0  # the longest a set of tiny jobs may go without any of them moving
START_S = 600.0  # for a job to reach a point (running, a step) or to run again; generous: the machine is shared


def job_row(svc: Service, job_id: str) -> Job:
    with session_scope(svc.observer_url) as session:
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        session.expunge(job)
        return job


def run_pid(svc: Service, job_id: str) -> int | None:
    try:
        return int(run_paths(job_id, svc.settings).pid_file.read_text())
    except (OSError, ValueError):
        return None


def mid_training(svc: Service, job_id: str, step: int) -> Job | None:
    """The job's row once it runs past ``step`` with a checkpoint on disk (None before)."""
    job = job_row(svc, job_id)
    if job.status != JobStatus.running or job.progress_step < step:
        return None
    return job if newest_checkpoint(run_paths(job_id, svc.settings).output_dir) is not None else None


def wait_terminal(svc: Service, job_ids: list[str], stall_s: float = FINISH_S) -> None:
    """Until every job is terminal, or none of them moved (status, attempt, step) for ``stall_s``: the
    verdict then counts the stragglers as lost. A loaded machine slows the jobs down, it does not stop
    them, so the bound is on a stall, not on the total time."""
    last: dict[str, tuple[str, int, int]] = {}
    moved = time.monotonic()
    while True:
        now = job_progress(svc.observer_url, job_ids)
        if all(status in TERMINAL for status, _, _ in now.values()):
            return
        if now != last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            return
        time.sleep(0.5)


def running_again(svc: Service, job_id: str, attempts: int) -> bool:
    job = job_row(svc, job_id)
    return job.status in TERMINAL or (job.status == JobStatus.running and job.attempts > attempts)


def keep_workers(svc: Service, n: int = 2) -> None:
    """Start workers until ``n`` are alive (a killed one is replaced, as a process manager would)."""
    while len(svc.live_workers()) < n:
        svc.start_worker(wait=False)


R1_TRAINING = {"max_steps": 300, "save_steps": 10}  # 6-10 s of training: time to catch it mid-way


def inject(svc: Service, job: Job, kind: str) -> None:
    """SIGKILL the run, the slot or the worker main of ``job`` (both for ``main-no-restart``)."""
    slot = int(job.pid or 0)
    main = parent_of(slot)
    if main is None:  # never os.kill(0): that is the bench's own process group
        raise ProcessLookupError(f"the slot {slot} of job {job.id} is gone before the kill")
    if kind == "run":
        os.kill(run_pid(svc, job.id) or 0, signal.SIGKILL)
        return
    if kind in ("slot", "main-no-restart"):
        os.kill(slot, signal.SIGKILL)
    if kind in ("main", "main-no-restart"):
        os.kill(main, signal.SIGKILL)
    wait_for(lambda: not is_alive(main), 60, "the killed worker to be gone")
    if kind != "main-no-restart":  # without a restart, the other worker's sweep must take over
        keep_workers(svc)


def r1_kills(svc: Service, trials: int, leases: bool, first: int = 0) -> Row:
    """R1: SIGKILL the run, the slot or the worker main mid-training; the job resumes from its
    checkpoint and succeeds once, one loss point per step. One job per worker at a time; the kinds of
    kill take turns, starting with ``kinds[first]``."""
    row = Row("R1", svc.shape)
    kinds = ["run", "slot", "main"] + (["main-no-restart"] if leases else [])
    if not leases:
        row.note = "kill with no worker restart: blocked: needs leases"
    done = 0
    while done < trials:
        batch = [kinds[(first + i) % len(kinds)] for i in range(done, min(trials, done + len(svc.live_workers())))]
        ids: list[str] = []
        killed: dict[str, tuple[int, float]] = {}
        for kind in batch:
            # Submitted one at a time, each once the one before was killed: a forked run trains its
            # 300 steps in ~6 s, so a job submitted with the batch could end while the bench is still
            # killing the one before it (and was then never caught mid-training).
            job_id = svc.submit(f"r1-{kind}", R1_TRAINING, resources={"max_restarts": 3})
            ids.append(job_id)
            try:
                job = wait_for(lambda: mid_training(svc, job_id, 12), START_S, f"R1 {job_id} mid-training", 0.1)  # noqa: B023
            except TimeoutError as exc:
                row.fail(str(exc))
                continue
            killed[job_id] = (job.attempts, time.monotonic())
            inject(svc, job, kind)
        for job_id, (attempts, started) in killed.items():
            try:
                wait_for(lambda: running_again(svc, job_id, attempts), START_S, f"R1 {job_id}: to run again")  # noqa: B023
                row.recovered(time.monotonic() - started)
            except TimeoutError as exc:
                row.fail(str(exc))
        wait_terminal(svc, ids)
        keep_workers(svc)
        for kind, job_id in zip(batch, ids, strict=True):
            facts = job_facts(svc.observer_url, job_id)
            verdict = judge(facts, JobStatus.succeeded)
            verdict.why = [f"{kind} kill: {why}" for why in verdict.why]
            if facts.attempts < 2:
                verdict.wrong = True
                verdict.why.append(f"{job_id}: the {kind} kill did not make it restart (attempts {facts.attempts})")
            row.add(verdict)
        row.trials += len(batch)
        done += len(batch)
    return row


def r2_double_delivery(svc: Service, trials: int) -> Row:
    """R2: the same message sent twice to two idle workers: one claim, one run."""
    from service_core.queue import enqueue_job

    row = Row("R2", svc.shape)
    for _ in range(trials):
        job_id = svc.submit("r2", {"max_steps": 8})
        enqueue_job(job_id, svc.queue, 0, svc.settings)  # the duplicate; both workers are idle
        wait_terminal(svc, [job_id])
        row.add(judge(job_facts(svc.observer_url, job_id), JobStatus.succeeded, one_attempt=True))
        row.trials += 1
    return row


def r4_cancels(svc: Service, trials: int) -> Row:
    """R4: cancel running jobs: ``cancelled`` within the grace period (+ one step), no process left."""
    row = Row("R4", svc.shape, note=f"bound: grace {GRACE_S:.0f} s + 10 s")
    while row.trials < trials:
        batch = min(len(svc.live_workers()), trials - row.trials)
        ids = [svc.submit("r4", {"max_steps": 100_000}) for _ in range(batch)]
        try:
            wait_for(lambda: all(job_row(svc, j).progress_step >= 2 for j in ids), START_S, "R4 jobs running")  # noqa: B023
        except TimeoutError as exc:
            row.fail(str(exc))
        pids = {j: run_pid(svc, j) for j in ids}
        asked = {}
        for job_id in ids:
            asked[job_id] = time.monotonic()
            if svc.cancel(job_id) != 202:
                row.fail(f"{job_id}: cancel refused")
        for job_id in ids:
            try:
                wait_for(lambda: job_row(svc, job_id).status in TERMINAL, GRACE_S + 60, "cancelled")  # noqa: B023
                took = time.monotonic() - asked[job_id]
                row.recovered(took)
                if took > GRACE_S + 10:
                    row.fail(f"{job_id}: cancelled after {took:.1f} s")
            except TimeoutError as exc:
                row.fail(f"{job_id}: {exc}")
            try:
                wait_for(lambda: not is_alive(pids[job_id]), 10, "the run process to go")  # noqa: B023
            except TimeoutError:
                row.fail(f"{job_id}: run process {pids[job_id]} left after the cancel")
            row.add(judge(job_facts(svc.observer_url, job_id), JobStatus.cancelled, every_step=False))
            row.trials += 1
    return row


def r9_storm(svc: Service, jobs: int, kills: int, seed: int = 0) -> Row:
    """R9: many tiny jobs on two workers while runs and workers are killed at random: none lost, and
    the counts by status agree with each job's last status event."""
    rng = random.Random(seed)
    row = Row("R9", svc.shape, note=f"{jobs} jobs, {kills} kills; recovery = last kill to all done")
    # Long enough for the kills to find runs on a quiet machine too, where a forked run starts in under
    # a second and trains 100 steps in about half of one: there the short form's 4 jobs on two workers
    # were done 3 s in, after one kill of two (kills 0.3-1.5 s apart). 200 steps, and kills 0.1-0.8 s
    # apart: the full form's 20 kills still spread over its 60 jobs.
    ids = [svc.submit(f"r9-{i}", {"max_steps": 200, "save_steps": 10}, resources={"max_restarts": 20})
           for i in range(jobs)]  # fmt: skip
    last_kill = time.monotonic()
    done = 0
    deadline = time.monotonic() + FINISH_S + jobs * 10
    while done < kills and time.monotonic() < deadline:
        time.sleep(rng.uniform(0.1, 0.8))
        statuses = job_statuses(svc.observer_url, ids)
        if all(s in TERMINAL for s in statuses.values()):
            break
        running = [j for j, s in statuses.items() if s == JobStatus.running]
        if not running:
            continue
        victim = rng.choice(running)
        if rng.random() < 0.7:
            pid = run_pid(svc, victim)
            if is_alive(pid):
                os.kill(pid or 0, signal.SIGKILL)
            else:
                continue
        else:
            slot = job_row(svc, victim).pid
            if not is_alive(slot):
                continue
            main = parent_of(int(slot or 0))
            if main not in {w.pid for w in svc.live_workers()}:
                continue
            os.kill(main, signal.SIGKILL)
            wait_for(lambda: not is_alive(main), 60, "the killed worker to be gone")  # noqa: B023
            keep_workers(svc)
        done += 1
        last_kill = time.monotonic()
    if done < kills:  # a storm that injected less than planned tested less than it says
        row.fail(f"only {done} of {kills} kills landed before the jobs ended")
    wait_terminal(svc, ids)
    row.recovered(time.monotonic() - last_kill)
    for job_id in ids:
        facts = job_facts(svc.observer_url, job_id)
        row.add(judge(facts, JobStatus.succeeded))
        last_event = facts.statuses[-1]["status"] if facts.statuses else None
        if last_event != facts.status:
            row.fail(f"{job_id}: status {facts.status}, last status event {last_event}")
        row.trials += 1
    row.note = f"{jobs} jobs, {done} kills; recovery = last kill to all done"
    return row
