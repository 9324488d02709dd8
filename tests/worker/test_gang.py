"""Gang claims of multi-node jobs (worker/gang.py) on SQLite and PostgreSQL: slots (threads here, each
with the identity of a slot of its own worker) join, the gang forms all or nothing, two gangs never
deadlock, a gang that cannot form lets go and holds no slot, and each node keeps a lease of its own."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from service_core.datastore import FetchError
from service_core.db.base import utcnow
from service_core.db.models import JobNode, WorkerHeartbeat
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from tests.api.test_jobs import drain_broker
from trainer_core.launch import OTHER_NODE
from worker import execute, gang
from worker.execute import Claimed, claim_job, execute_attempt
from worker.gang import HELD, JOINED, Gang, Member
from worker.outcome import RunOutcome
from worker.paths import run_reach
from worker.recovery import recover_orphaned_jobs

from .conftest import JobFactory, load_job

WAIT_S = 3.0


def member(name: str, worker: str | None = None) -> Member:
    return Member(slot=f"{name}-slot", worker=worker or f"{name}-worker", host=name, pid=4_000_000 + len(name),
                  address="127.0.0.1", port=gang.free_port("127.0.0.1"))  # fmt: skip


def quick(settings: Settings) -> Settings:
    return settings.model_copy(update={"gang_wait_seconds": WAIT_S})


def gang_job(settings: Settings, make_job: JobFactory, nodes: int) -> str:
    job_id = make_job(settings, {"name": f"gang-{nodes}"}, nodes=nodes, enqueued_at=utcnow())
    time.sleep(0.01)  # created_at orders the gangs
    return job_id


class Slot(threading.Thread):
    """One slot taking one message: claim_gang's answer lands in ``result``."""

    def __init__(self, settings: Settings, job_id: str, who: Member) -> None:
        super().__init__(daemon=True)
        self.settings, self.job_id, self.who = settings, job_id, who
        self.result: tuple[str, Gang] | None = None

    def run(self) -> None:
        self.result = gang.claim_gang(self.job_id, self.settings, self.who)


def start(slots: list[Slot], gap_s: float = 0.3) -> None:
    for slot in slots:
        slot.start()
        time.sleep(gap_s)  # each joins before the next: the join order is the test's


def nodes_of(settings: Settings, job_id: str) -> list[tuple[str, int | None]]:
    with session_scope(settings.database_url) as session:
        rows = session.execute(
            select(JobNode.slot, JobNode.node).where(JobNode.job_id == job_id).order_by(JobNode.slot)
        )
        return [(slot, node) for slot, node in rows]


def test_two_gangs_of_three_on_four_slots_never_deadlock(db_settings: Settings, make_job: JobFactory) -> None:
    settings = quick(db_settings)
    older, younger = gang_job(settings, make_job, 3), gang_job(settings, make_job, 3)
    # Two slots take the older job's messages, two the younger's: each gang holds half of what it needs.
    slots = [Slot(settings, older, member("a")), Slot(settings, older, member("b")),
             Slot(settings, younger, member("c")), Slot(settings, younger, member("d"))]  # fmt: skip
    start(slots)
    for slot in slots:
        slot.join(timeout=3 * WAIT_S)
    # A waiting member moved to the older gang, which formed with three nodes on one rendezvous.
    formed = [slot.result for slot in slots if slot.result is not None]
    assert len(formed) == 3 and {job for job, _ in formed} == {older}
    places = sorted((place.node, place.nodes, place.endpoint) for _, place in formed)
    assert [node for node, _, _ in places] == [0, 1, 2] and len({(n, e) for _, n, e in places}) == 1
    job = load_job(settings, older)
    assert (job.status, job.attempts, job.worker, job.waiting_reason) == ("running", 1, "a", None)
    # The younger gang could not form: it let go, and holds no slot.
    waiting = load_job(settings, younger)
    assert waiting.status == "queued" and waiting.enqueued_at is None
    assert (waiting.waiting_reason or "").startswith("waiting: needs 3 nodes")
    assert nodes_of(settings, younger) == []


def test_a_member_that_loses_the_race_for_an_older_gang_goes_back_to_its_own(
    db_settings: Settings, make_job: JobFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two members of one gang both saw room in an older gang; the first took the last place. The second
    goes back to its own gang, which then lets go as usual (held, with its reason). It used to drop out,
    leaving its gang with no member and never held: seen as a flake of the test above under load."""
    settings = quick(db_settings)
    older, younger = gang_job(settings, make_job, 3), gang_job(settings, make_job, 2)
    with session_scope(settings.database_url) as session:
        for name in ("a", "b", "c"):  # the older gang is full (not formed yet): the last place is gone
            assert gang.join(session, older, member(name), settings.lease_seconds) == JOINED
    looks = iter([older])  # what the losing member read an instant before the winner joined
    monkeypatch.setattr(gang, "older_gang", lambda *_: next(looks, None))
    assert gang.claim_gang(younger, settings, member("d")) is None  # it waited in its own gang, then let go
    assert [slot for slot, _ in nodes_of(settings, older)] == ["a-slot", "b-slot", "c-slot"]
    job = load_job(settings, younger)
    assert job.status == "queued" and job.enqueued_at is None and nodes_of(settings, younger) == []
    assert (job.waiting_reason or "").startswith("waiting: needs 2 nodes")


def test_two_gangs_of_two_on_three_slots_run_one_after_the_other(db_settings: Settings, make_job: JobFactory) -> None:
    settings = quick(db_settings).model_copy(update={"gang_wait_seconds": 60.0})
    first, second = gang_job(settings, make_job, 2), gang_job(settings, make_job, 2)
    a, b, c = member("a"), member("b"), member("c")
    # a takes the first job's message, b the second's: b moves to the older gang, which forms.
    slots = [Slot(settings, first, a), Slot(settings, second, b)]
    start(slots)
    for slot in slots:
        slot.join(timeout=10)
    assert [slot.result[0] if slot.result else None for slot in slots] == [first, first]
    assert load_job(settings, first).status == "running" and nodes_of(settings, second) == []
    # The second job's recruiting message is still queued: c takes it and waits, holding one slot.
    assert [second] in [m["args"] for m in drain_broker(settings, "default")]
    waiting = Slot(settings, second, c)
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive() and nodes_of(settings, second) == [("c-slot", None)]
    # The first job ends; a's slot takes c's recruiting message and completes the second gang.
    with session_scope(settings.database_url) as session:
        session.execute(JobNode.__table__.delete().where(JobNode.job_id == first))
    assert [second] in [m["args"] for m in drain_broker(settings, "default")]
    late = Slot(settings, second, a)
    late.start()
    for slot in (late, waiting):
        slot.join(timeout=10)
    assert late.result is not None and waiting.result is not None
    assert (waiting.result[1].node, late.result[1].node) == (0, 1)
    assert load_job(settings, second).status == "running"


def test_a_gang_that_cannot_form_waits_queued_with_its_reason_and_holds_no_slot(
    db_settings: Settings, make_job: JobFactory
) -> None:
    settings = quick(db_settings)
    job_id = gang_job(settings, make_job, 2)
    with session_scope(settings.database_url) as session:
        session.add(WorkerHeartbeat(name="a-worker", queues=["default"], slots=1, busy=0, heartbeat_at=utcnow()))
    slot = Slot(settings, job_id, member("a"))
    slot.start()
    time.sleep(1.0)
    assert load_job(settings, job_id).waiting_reason == "forming: 1 of 2 nodes joined"
    slot.join(timeout=3 * WAIT_S)
    assert slot.result is None
    job = load_job(settings, job_id)
    assert job.status == "queued" and job.enqueued_at is None and nodes_of(settings, job_id) == []
    assert "needs 2 nodes" in (job.waiting_reason or "") and "1 of the queue's 1 live workers" in job.waiting_reason
    # Its recruiting message, still in flight, is dropped by whoever takes it: no slot is held.
    with session_scope(settings.database_url) as session:
        assert gang.join(session, job_id, member("b"), settings.lease_seconds) == HELD
    assert nodes_of(settings, job_id) == []
    # Sent again only once two workers of its queue have a free slot.
    assert gang.resend_gangs(settings) == []
    with session_scope(settings.database_url) as session:
        session.add(WorkerHeartbeat(name="b-worker", queues=["default"], slots=2, busy=1, heartbeat_at=utcnow()))
    assert gang.resend_gangs(settings) == [job_id]
    assert load_job(settings, job_id).enqueued_at is not None


def test_two_slots_of_one_worker_never_share_a_gang(db_settings: Settings, make_job: JobFactory) -> None:
    settings = quick(db_settings)
    job_id = gang_job(settings, make_job, 2)
    with session_scope(settings.database_url) as session:
        assert gang.join(session, job_id, member("a", worker="box"), settings.lease_seconds) == JOINED
    drain_broker(settings, "default")
    assert gang.claim_gang(job_id, settings, member("b", worker="box")) is None
    assert nodes_of(settings, job_id) == [("a-slot", None)]
    # The message went back to the queue, for a slot of another worker.
    assert drain_broker(settings, "default") == [{"task": "trainjobs.run_job", "args": [job_id]}]


def test_a_node_that_stops_renewing_ends_the_attempt_of_every_node(db_settings: Settings, make_job: JobFactory) -> None:
    settings = db_settings.model_copy(update={"lease_seconds": 2.0, "lease_renew_seconds": 0.5})
    job_id = gang_job(settings, make_job, 2)
    a, b = member("a"), member("b")
    with session_scope(settings.database_url) as session:
        assert gang.join(session, job_id, a, settings.lease_seconds) == JOINED
        assert gang.join(session, job_id, b, settings.lease_seconds) == JOINED
    with session_scope(settings.database_url) as session:
        assert gang.form(session, job_id, settings.lease_seconds)
    # Node a renews; node b's host is lost. The job's lease is the earliest of its nodes'.
    with session_scope(settings.database_url) as session:
        session.execute(JobNode.__table__.update().where(JobNode.slot == b.slot)
                        .values(lease_expires_at=utcnow() - timedelta(seconds=1)))  # fmt: skip
        assert gang.renew_node_lease(session, job_id, 1, a.slot, settings.lease_seconds)
    job = load_job(settings, job_id)
    assert job.lease_expires_at is not None and job.lease_expires_at.replace(tzinfo=None) < utcnow().replace(
        tzinfo=None
    )
    # The sweep requeues it (one restart spent), and node a's next renewal is refused: it is fenced out.
    assert recover_orphaned_jobs(settings, host="sweeper-host") == {job_id: "queued"}
    with session_scope(settings.database_url) as session:
        assert not gang.renew_node_lease(session, job_id, 1, a.slot, settings.lease_seconds)
    # The next gang forms afresh: the ended attempt's rows go.
    with session_scope(settings.database_url) as session:
        assert gang.join(session, job_id, member("c"), settings.lease_seconds) == JOINED
    assert nodes_of(settings, job_id) == [("c-slot", None)]


def test_a_node_fetching_its_data_for_longer_than_a_lease_keeps_the_gang_alive(
    db_settings: Settings, make_job: JobFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first fetch of the job's data may outlast the lease. The fetching node renews its own row
    meanwhile: the other node's renewals (the job's lease is the nodes' earliest) keep the job's lease
    ahead, the sweep leaves the gang alone, and the attempt ends as the fetch does, once."""
    # A lease of 2.5 s, not 1: the sweep's first look comes after the attempt starts its keeper and the
    # fetch starts, which under the suite's load took over a second (the sweep then rightly requeued).
    settings = db_settings.model_copy(update={"lease_seconds": 2.5, "lease_renew_seconds": 0.25})
    job_id = gang_job(settings, make_job, 2)
    a, b = replace(member("a"), slot=gang.slot_name()), member("b")  # this process is node a's slot
    with session_scope(settings.database_url) as session:
        assert gang.join(session, job_id, a, settings.lease_seconds) == JOINED
        assert gang.join(session, job_id, b, settings.lease_seconds) == JOINED
    with session_scope(settings.database_url) as session:
        assert gang.form(session, job_id, settings.lease_seconds)
        place = gang.place(session, job_id, a.slot)
    assert place is not None and place.attempt == 1
    fetching, swept = threading.Event(), []

    def slow_fetch(spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
        fetching.set()
        time.sleep(4 * settings.lease_seconds)  # a large dataset from the store
        raise FetchError("data.train_file", "no such object on the store")

    def node_b_and_the_sweep() -> None:  # node b runs, renewing its row; a sweep runs beside it
        fetching.wait(10)
        while fetching.is_set():
            with session_scope(settings.database_url) as session:
                gang.renew_node_lease(session, job_id, 1, b.slot, settings.lease_seconds)
            swept.append(recover_orphaned_jobs(settings, host="sweeper-host"))
            time.sleep(settings.lease_renew_seconds)

    monkeypatch.setattr(execute, "localize_spec", slow_fetch)
    other = threading.Thread(target=node_b_and_the_sweep, daemon=True)
    other.start()
    claimed = Claimed(1, {"task": "text-classification"}, None, run_reach(settings, "alice", False), job_id, place)
    try:
        ended = execute_attempt(job_id, settings, claimed, lambda: False)
    finally:
        fetching.clear()
        other.join(10)
    assert len(swept) >= 10 and not any(swept), swept
    job = load_job(settings, job_id)
    assert (ended, job.status, job.attempts, job.error_reason) == ("failed", "failed", 1, "data_error")
    assert "data.train_file" in (job.error_message or "")


def test_node_0_picks_its_rendezvous_port_from_the_range_a_firewall_opens() -> None:
    port = gang.free_port("127.0.0.1", "29400-29419")
    assert 29400 <= port <= 29419
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        with pytest.raises(OSError, match="TRAINJOBS_RENDEZVOUS_PORTS"):
            gang.free_port("127.0.0.1", f"{busy}-{busy}")
    assert gang.interface_of("127.0.0.1") == "lo"  # gloo's interface for an address


def test_how_one_nodes_run_ending_ends_the_gangs_attempt() -> None:
    finished = RunOutcome(JobStatus.succeeded, summary={OTHER_NODE: "without rank 0"})
    assert gang.node_outcome(finished) is None  # rank 0's node records the end
    assert gang.node_outcome(RunOutcome(JobStatus.succeeded)) == RunOutcome(JobStatus.succeeded)
    # a peer's failure broke this node's collectives: the whole gang restarts
    broken = gang.node_outcome(RunOutcome(JobStatus.failed, ErrorReason.internal, "torchrun exited with status 1"))
    assert broken is not None and (broken.status, broken.reason) == (JobStatus.failed, ErrorReason.worker_lost)
    # asked to stop, its ranks exited non-zero: the stop it was asked for, not a failure
    stopped = RunOutcome(JobStatus.failed, ErrorReason.internal, stopped_by=ErrorReason.cancelled)
    cancelled = gang.node_outcome(stopped)
    assert cancelled is not None and (cancelled.status, cancelled.reason) == ("cancelled", "cancelled")
    # a node without rank 0 leaves a cancel or pause to rank 0's node, but requeues when its own worker stops
    for asked in (ErrorReason.cancelled, ErrorReason.paused):
        for status in (JobStatus.succeeded, JobStatus.failed):
            other = RunOutcome(status, summary={OTHER_NODE: "without rank 0"}, stopped_by=asked)
            assert gang.node_outcome(other) is None
    stopping = RunOutcome(JobStatus.failed, ErrorReason.internal, summary={OTHER_NODE: "without rank 0"},
                          stopped_by=ErrorReason.shutdown_requeue)  # fmt: skip
    requeued = gang.node_outcome(stopping)
    assert requeued is not None and requeued.reason == ErrorReason.shutdown_requeue
    # a peer stopped for a cancel first broke this node's collectives before its own poll saw the cancel
    # (seen: the cancelled gang recorded failed, worker_lost): read after the run, the cancel is the end
    late = RunOutcome(JobStatus.failed, ErrorReason.internal, "torchrun exited with status 1")
    assert gang.node_outcome(replace(late, summary={OTHER_NODE: "without rank 0"}), ErrorReason.cancelled) is None
    for asked in (ErrorReason.cancelled, ErrorReason.paused):
        seen_late = gang.node_outcome(late, asked)
        assert seen_late is not None and (seen_late.status, seen_late.reason) == ("cancelled", asked)
    assert gang.node_outcome(late, ErrorReason.shutdown_requeue) == broken  # not a user's stop: lost
    oom = RunOutcome(JobStatus.failed, ErrorReason.out_of_memory, stopped_by=ErrorReason.cancelled)
    assert gang.node_outcome(oom) == oom  # the out-of-memory path keeps its own retry
    bad_data = RunOutcome(JobStatus.failed, ErrorReason.data_error)
    assert gang.node_outcome(bad_data) == bad_data  # a user's error never restarts


def test_a_plain_claim_never_takes_a_job_of_several_nodes(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = gang_job(db_settings, make_job, 2)
    with session_scope(db_settings.database_url) as session:
        assert claim_job(session, job_id) is None  # a slot joins its gang instead (worker/execute.py:claim)
    assert (load_job(db_settings, job_id).status, load_job(db_settings, job_id).attempts) == ("queued", 0)
