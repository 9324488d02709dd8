"""What the chaos bench counts: each job's facts read from the database, and one table row per scenario.

A job is **lost** when it never reaches a terminal status; **duplicated** when it ran or ended twice
(two terminal status events, a repeated loss point, or a second attempt where one was expected);
**wrong** when its final status is not the expected one, an event landed after its final status, or
its step count or loss points have gaps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from service_core.db import Job, JobEvent, MetricPoint
from service_core.db.session import session_scope
from service_core.status import JobStatus

TERMINAL = {s.value for s in JobStatus if s.terminal}


@dataclass
class JobFacts:
    id: str
    status: str
    attempts: int
    progress_step: int
    progress_total: int | None
    statuses: list[dict[str, Any]]  # the data of every status event, in order
    events_after_final: int
    loss_steps: list[int]  # in seq order

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def job_facts(database_url: str, job_id: str) -> JobFacts:
    """Everything the verdict needs about one job, in one session."""
    with session_scope(database_url) as session:
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        events = session.execute(
            select(JobEvent.seq, JobEvent.kind, JobEvent.data).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)
        ).all()
        loss = session.execute(
            select(MetricPoint.step).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
            .order_by(MetricPoint.seq)
        ).scalars().all()  # fmt: skip
        statuses = [dict(data) for _, kind, data in events if kind == "status"]
        final_seq = max((seq for seq, kind, data in events if kind == "status" and data.get("status") in TERMINAL),
                        default=None)  # fmt: skip
        after = sum(1 for seq, _, _ in events if final_seq is not None and seq > final_seq)
        return JobFacts(job.id, job.status, job.attempts, job.progress_step, job.progress_total, statuses, after,
                        list(loss))  # fmt: skip


def job_statuses(database_url: str, job_ids: list[str]) -> dict[str, str]:
    with session_scope(database_url) as session:
        rows = session.execute(select(Job.id, Job.status).where(Job.id.in_(job_ids))).all()
        return {job_id: status for job_id, status in rows}


def job_progress(database_url: str, job_ids: list[str]) -> dict[str, tuple[str, int, int]]:
    """Each job's (status, attempts, step): what changes while jobs move on."""
    with session_scope(database_url) as session:
        rows = session.execute(
            select(Job.id, Job.status, Job.attempts, Job.progress_step).where(Job.id.in_(job_ids))
        ).all()
        return {job_id: (status, attempts, step) for job_id, status, attempts, step in rows}


@dataclass
class Verdict:
    lost: bool = False
    duplicated: bool = False
    wrong: bool = False
    why: list[str] = field(default_factory=list)


def judge(facts: JobFacts, expect: str, *, one_attempt: bool = False, every_step: bool = True) -> Verdict:
    """The verdict on one job expected to end ``expect``.

    ``one_attempt``: it must have run exactly once (one ``running`` event, attempts 1).
    ``every_step``: it logged the loss every step, so a succeeded job has exactly one point per step.
    """
    v = Verdict()
    if not facts.terminal:
        v.lost = True
        v.why.append(f"{facts.id} still {facts.status}")
        return v
    finals = [s for s in facts.statuses if s.get("status") in TERMINAL]
    running = [s for s in facts.statuses if s.get("status") == JobStatus.running]
    if len(finals) > 1:
        v.duplicated = True
        v.why.append(f"{facts.id}: {len(finals)} terminal status events")
    if one_attempt and (facts.attempts != 1 or len(running) != 1):
        v.duplicated = True
        v.why.append(f"{facts.id}: attempts {facts.attempts}, {len(running)} running events")
    repeats = [step for step, n in Counter(facts.loss_steps).items() if n > 1]
    if repeats:
        v.duplicated = True
        v.why.append(f"{facts.id}: loss logged twice at steps {repeats[:5]}")
    if facts.status != expect:
        v.wrong = True
        v.why.append(f"{facts.id}: {facts.status} (expected {expect}) after {[s.get('status') for s in facts.statuses]}"
                     f" {(finals[-1].get('message') or '')[:200] if finals else ''}")  # fmt: skip
    if facts.events_after_final:
        v.wrong = True
        v.why.append(f"{facts.id}: {facts.events_after_final} events after the final status")
    if expect == JobStatus.succeeded and facts.status == expect:
        total = facts.progress_total or 0
        if facts.progress_step != total:
            v.wrong = True
            v.why.append(f"{facts.id}: step {facts.progress_step}/{total}")
        have, want = set(facts.loss_steps), set(range(1, total + 1))
        if every_step and have != want:
            v.wrong = True
            # Which steps, and the attempts' history: enough to tell a lost point from a rewind gone wrong.
            history = [(s.get("status"), (s.get("message") or "")[:80]) for s in facts.statuses]
            v.why.append(f"{facts.id}: loss steps not 1..{total}: missing {sorted(want - have)[:10]},"
                         f" extra {sorted(have - want)[:10]}; statuses {history}")  # fmt: skip
    return v


@dataclass
class Row:
    """One line of the table."""

    scenario: str
    shape: str
    trials: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    recovery_s: float = 0.0
    note: str = ""
    blocked: bool = False  # not run: shown with dashes and its note
    applicable: bool = True  # False: not run because it cannot mean anything on this shape (the note says why)
    why: list[str] = field(default_factory=list)

    def add(self, verdict: Verdict) -> None:
        self.lost += verdict.lost
        self.duplicated += verdict.duplicated
        self.wrong += verdict.wrong
        self.why.extend(verdict.why)

    def recovered(self, seconds: float) -> None:
        self.recovery_s = max(self.recovery_s, seconds)

    def fail(self, why: str) -> None:
        """A scenario-level failure (the service did not do what was expected): counted as wrong."""
        self.wrong += 1
        self.why.append(why)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.wrong)


HEADER = f"{'scenario':<9}{'shape':<12}{'trials':>7}{'lost':>6}{'duplicated':>12}{'wrong':>7}{'recovery s':>12}  note"


def render(rows: list[Row]) -> str:
    """The one table the bench prints, then each failed row's reasons."""
    lines = [HEADER, "-" * len(HEADER)]
    for r in rows:
        if r.blocked:
            lines.append(f"{r.scenario:<9}{r.shape:<12}{'-':>7}{'-':>6}{'-':>12}{'-':>7}{'-':>12}  {r.note}")
            continue
        lines.append(f"{r.scenario:<9}{r.shape:<12}{r.trials:>7}{r.lost:>6}{r.duplicated:>12}{r.wrong:>7}"
                     f"{r.recovery_s:>12.1f}  {r.note}")  # fmt: skip
    for r in rows:
        for why in r.why[:10]:
            lines.append(f"  {r.scenario} {r.shape}: {why}")
    return "\n".join(lines)
