"""Multi-node jobs: N slots of N different workers join one job's gang, all or nothing, then run it
together on torchrun's c10d rendezvous.

A job of ``resources.num_nodes`` N > 1 travels as one queue message, like any other. The slot that takes
it **joins** the gang (a row in ``job_nodes``, under a lease of its own) and, while the gang is short,
sends the job's message once more to **recruit** the next member: one message is in flight per forming
gang, whatever path sent the first (a submit, a requeue, the sweep). Every join runs under the job row's
lock (a no-op UPDATE first: the row lock on PostgreSQL, the write lock on SQLite), so a gang never takes
more than N members nor two slots of one worker.

The member that completes the gang **forms** it: ``queued -> running`` with ``attempts + 1`` (the
compare-and-set every claim makes), the members numbered by join order. Node 0's advertised address
and the free port it picked are the rendezvous endpoint, and node 0 hosts torchrun's store there.

**Oldest first.** A waiting member moves to an older forming gang of its queue that lacks its worker
(and goes back to its own when another member took the last place first).
So two gangs never each hold part of the slots they both need: whichever is oldest fills first (the
test: two 3-node jobs on four slots).

**Letting go.** When the gang is not complete ``TRAINJOBS_GANG_WAIT_SECONDS`` after its first member
joined, every member leaves and the job stays ``queued``, held: ``waiting_reason`` says how many nodes
it needs and how many workers of the queue have a free slot, ``enqueued_at`` is NULL (so the recruiting
message still in flight is dropped by whoever takes it). The sweep sends it again once that many
workers of the queue report a free slot (:func:`resend_gangs`). No slot is held by a gang meanwhile.

**Running.** Each node renews its own row's lease, and the job's lease is the earliest of them: when any
node stops renewing (its host lost), the sweep requeues the job as for a lost single-node slot, spending
one of ``resources.max_restarts``, and every other node's next renewal is refused (the attempt is fenced
out), which kills its run. A node whose run fails ends the attempt the same way (:func:`worker.execute`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from service_core.db.base import as_utc, utcnow
from service_core.db.jobstore import fence, transition
from service_core.db.models import Job, JobNode, live_workers
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.launch import OTHER_NODE, Rendezvous
from worker.outcome import RunOutcome
from worker.paths import host_name, process_name, worker_of_slot

log = logging.getLogger(__name__)

POLL_S = 0.5
# Why a message did not make this slot a member.
JOINED, FULL, SAME_WORKER, NOT_QUEUED, HELD = "joined", "full", "same worker", "not queued", "held"
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class Member:
    """A slot as a gang sees it: itself, its worker (main process), its host and where it is reached."""

    slot: str
    worker: str
    host: str
    pid: int
    address: str
    port: int


@dataclass(frozen=True)
class Gang:
    """This slot's place in a formed gang: the attempt, its node rank, and where the nodes meet."""

    attempt: int
    node: int
    nodes: int
    endpoint: str
    address: str

    def rendezvous(self, job_id: str) -> Rendezvous:
        # One id per attempt: a restarted gang never meets a stale node of the attempt before.
        return Rendezvous(self.endpoint, f"{job_id}-{self.attempt}", local_addr=self.address, is_host=self.node == 0)


def advertise_address(settings: Settings) -> str:
    """Where this host's nodes are reached: ``TRAINJOBS_ADVERTISE_HOST``, else the address this host
    reaches the database from (the interface a fleet shares), else 127.0.0.1 (one machine)."""
    if settings.advertise_host:
        return settings.advertise_host
    target = make_url(settings.database_url).host or _broker_host(settings.broker_url)
    if not target:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # UDP: no packet is sent, the kernel only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _broker_host(url: str) -> str | None:
    with contextlib.suppress(Exception):
        return make_url(url.replace("sqla+", "")).host
    return None


def free_port(address: str, ports: str | None = None) -> int:
    """A port free on ``address`` now (the rendezvous binds it when the gang starts): any, or one of
    ``ports`` (``TRAINJOBS_RENDEZVOUS_PORTS``, "LOW-HIGH"), tried in a random order."""
    low, high = (int(end) for end in ports.split("-")) if ports else (0, 0)
    candidates = random.sample(range(low, high + 1), high - low + 1) if ports else [0]
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free port in TRAINJOBS_RENDEZVOUS_PORTS={ports} on {address}")


def interface_of(address: str) -> str | None:
    """The network interface holding IPv4 ``address`` (gloo binds there: ``GLOO_SOCKET_IFNAME``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def run_env(gang: Gang) -> dict[str, str]:
    """What a node's run needs besides the usual environment: gloo on the advertised interface (it
    would resolve the host name, which a fleet's other hosts often cannot, and fall back to loopback)."""
    name = interface_of(gang.address)
    return {"GLOO_SOCKET_IFNAME": name} if name and name != "lo" else {}


def slot_name() -> str:
    """This slot's name in ``job_nodes``: its host and pid."""
    return process_name()


def this_member(settings: Settings) -> Member:
    host = host_name()
    address = advertise_address(settings)
    return Member(slot=slot_name(), worker=worker_of_slot(), host=host, pid=os.getpid(),
                  address=address, port=free_port(address, settings.rendezvous_ports))  # fmt: skip


def _lock(session: Session, job_id: str) -> Any:
    """The job's row, locked until the transaction ends (None: no such job)."""
    session.execute(update(Job).where(Job.id == job_id).values(attempts=Job.attempts, updated_at=Job.updated_at))
    return session.execute(
        select(Job.status, Job.attempts, Job.queue, Job.priority, Job.enqueued_at, Job.waiting_reason, Job.nodes,
               Job.created_at).where(Job.id == job_id)
    ).one_or_none()  # fmt: skip


def _members(session: Session, job_id: str, attempt: int) -> list[JobNode]:
    """The live members of the gang forming for ``attempt``, in join order. The rows of slots that died
    waiting go, and those of ended attempts (a lost host's node never removed its own)."""
    now = utcnow()
    gone = or_(JobNode.attempt < attempt, JobNode.lease_expires_at < now)
    session.execute(delete(JobNode).where(JobNode.job_id == job_id, gone))
    rows = session.execute(
        select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt)
        .order_by(JobNode.joined_at, JobNode.slot)
    ).scalars()  # fmt: skip
    return list(rows)


def is_held(job: Any) -> bool:
    return job.enqueued_at is None and job.waiting_reason is not None


def join(session: Session, job_id: str, member: Member, lease_s: float) -> str:
    """Add ``member`` to the job's forming gang; :data:`JOINED` or why not."""
    job = _lock(session, job_id)
    if job is None or job.status != JobStatus.queued.value:
        return NOT_QUEUED
    members = _members(session, job_id, job.attempts + 1)
    if any(m.slot == member.slot for m in members):
        return JOINED
    if is_held(job) and not members:
        return HELD  # the gang let go; the sweep sends the job again when enough workers are free
    if any(m.worker == member.worker for m in members):
        return SAME_WORKER
    if len(members) >= job.nodes:
        return FULL
    now = utcnow()
    session.add(JobNode(job_id=job_id, slot=member.slot, worker=member.worker, host=member.host, pid=member.pid,
                        attempt=job.attempts + 1, address=member.address, port=member.port, joined_at=now,
                        lease_expires_at=now + timedelta(seconds=lease_s)))  # fmt: skip
    joined = len(members) + 1
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(waiting_reason=f"forming: {joined} of {job.nodes} nodes joined", enqueued_at=job.enqueued_at or now)
    )
    return JOINED


def form(session: Session, job_id: str, lease_s: float) -> bool:
    """Start the job when its gang is complete: number the nodes, ``queued -> running``."""
    # Every waiting member calls this each poll: a plain count first, the lock only when it may form.
    looked = session.execute(select(Job.nodes, func.count(JobNode.slot)).join(JobNode, JobNode.job_id == Job.id)
                             .where(Job.id == job_id, Job.status == JobStatus.queued.value,
                                    JobNode.attempt == Job.attempts + 1).group_by(Job.nodes)).first()  # fmt: skip
    if looked is None or looked[1] < looked[0]:
        return False
    job = _lock(session, job_id)
    if job is None or job.status != JobStatus.queued.value:
        return False
    attempt = job.attempts + 1
    members = _members(session, job_id, attempt)
    if len(members) < job.nodes:
        return False
    for rank, member in enumerate(members[: job.nodes]):
        member.node = rank
    first = members[0]
    hosts = ", ".join(m.host for m in members[: job.nodes])
    return transition(
        session, job_id, JobStatus.running, expect=JobStatus.queued, message=f"{job.nodes} nodes: {hosts}",
        attempts=attempt, worker=first.host, pid=first.pid, waiting_reason=None,
        lease_expires_at=utcnow() + timedelta(seconds=lease_s),
    )  # fmt: skip


def place(session: Session, job_id: str, slot: str) -> Gang | None:
    """This slot's place in the job's running gang (None: not formed, or not with this slot)."""
    row = session.execute(select(JobNode).where(JobNode.job_id == job_id, JobNode.slot == slot)).scalar_one_or_none()
    if row is None or row.node is None:
        return None
    job = session.execute(select(Job.status, Job.attempts, Job.nodes).where(Job.id == job_id)).one()
    if job.status != JobStatus.running.value or job.attempts != row.attempt:
        return None
    first = session.execute(
        select(JobNode.address, JobNode.port).where(JobNode.job_id == job_id, JobNode.attempt == row.attempt,
                                                    JobNode.node == 0)
    ).one()  # fmt: skip
    return Gang(attempt=row.attempt, node=row.node, nodes=job.nodes, endpoint=f"{first.address}:{first.port}",
                address=row.address)  # fmt: skip


def leave(session: Session, job_id: str, slot: str) -> bool:
    """Leave the job's forming gang; False when it formed with this slot meanwhile (the slot runs it)."""
    _lock(session, job_id)  # one at a time with form(): a slot never leaves a gang as it forms
    gone = session.execute(delete(JobNode).where(JobNode.job_id == job_id, JobNode.slot == slot,
                                                 JobNode.node.is_(None)))  # fmt: skip
    formed = session.execute(select(JobNode.node).where(JobNode.job_id == job_id, JobNode.slot == slot)).first()
    return bool(gone.rowcount) or formed is None  # type: ignore[attr-defined]


def release(session: Session, job_id: str, slot: str) -> None:
    """This node's attempt ended: its row goes."""
    session.execute(delete(JobNode).where(JobNode.job_id == job_id, JobNode.slot == slot))


def free_workers(session: Session, queue: str, lease_s: float) -> tuple[int, int]:
    """Live workers of ``queue``: how many have a free slot, and how many there are."""
    serving = live_workers(session, lease_s, queue)
    return sum(1 for row in serving if row.slots > row.busy), len(serving)


def waiting_message(nodes: int, joined: int, free: int, serving: int, queue: str, wait_s: float) -> str:
    return (
        f"waiting: needs {nodes} nodes (a free slot on each of {nodes} workers of queue {queue!r}); {joined} joined "
        f"within {wait_s:g} s (TRAINJOBS_GANG_WAIT_SECONDS) and {free} of the queue's {serving} live workers have a "
        f"free slot; it starts when {nodes} do"
    )


def let_go(session: Session, job_id: str, slot: str, settings: Settings) -> bool:
    """Leave the gang; the first to leave holds the job (unsent, with its waiting reason). False when it
    formed with this slot meanwhile."""
    job = _lock(session, job_id)
    if job is None:
        return True
    joined = len(_members(session, job_id, job.attempts + 1))
    if not leave(session, job_id, slot):
        return False
    if job.status == JobStatus.queued.value and not is_held(job):
        free, serving = free_workers(session, job.queue, settings.lease_seconds)
        reason = waiting_message(job.nodes, joined, free, serving, job.queue, settings.gang_wait_seconds)
        session.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.queued.value)
                        .values(waiting_reason=reason, enqueued_at=None))  # fmt: skip
    return True


def older_gang(session: Session, job_id: str, member: Member) -> str | None:
    """An older job of the same queue whose gang is forming without ``member``'s worker, and has room."""
    job = session.execute(select(Job.queue, Job.created_at).where(Job.id == job_id)).one()
    forming = session.execute(
        select(Job.id, Job.nodes, func.count(JobNode.slot))
        .join(JobNode, JobNode.job_id == Job.id)
        .where(Job.queue == job.queue, Job.status == JobStatus.queued.value, Job.created_at < job.created_at,
               JobNode.attempt == Job.attempts + 1, JobNode.lease_expires_at >= utcnow())
        .group_by(Job.id, Job.nodes, Job.created_at).order_by(Job.created_at)
    ).all()  # fmt: skip
    for other, nodes, joined in forming:
        has_worker = session.execute(
            select(func.count()).select_from(JobNode).where(JobNode.job_id == other, JobNode.worker == member.worker)
        ).scalar_one()  # fmt: skip
        if joined < nodes and not has_worker:
            return str(other)
    return None


def _deadline(session: Session, job_id: str, wait_s: float) -> datetime | None:
    first = session.execute(select(func.min(JobNode.joined_at)).where(JobNode.job_id == job_id,
                                                                      JobNode.node.is_(None))).scalar_one()  # fmt: skip
    return None if first is None else as_utc(first) + timedelta(seconds=wait_s)


def send(settings: Settings, job_id: str) -> None:
    """Send the job's message once more (to recruit a member, or hand it to another worker)."""
    from service_core.queue import enqueue_job

    with session_scope(settings.database_url) as session:
        row = session.execute(select(Job.queue, Job.priority).where(Job.id == job_id)).one()
    enqueue_job(job_id, row.queue, row.priority, settings)


def claim_gang(
    job_id: str, settings: Settings, member: Member | None = None, should_stop: Callable[[], bool] = lambda: False
) -> tuple[str, Gang] | None:
    """Join the job's gang (or an older forming one) and wait for it to form: the job this slot runs and
    its place, or None when it runs none (the message did not make it a member, the gang let go, or the
    slot is stopping: ``should_stop``)."""
    member = member or this_member(settings)
    with session_scope(settings.database_url) as session:
        outcome = join(session, job_id, member, settings.lease_seconds)
    if outcome == SAME_WORKER:  # this worker is in already: hand the message to another worker's slot
        time.sleep(POLL_S)
        send(settings, job_id)
    if outcome != JOINED:
        log.info("job %s: not joining its gang (%s)", job_id, outcome)
        return None
    log.info("job %s: joined its gang as %s", job_id, member.slot)
    recruited = False
    renew_at = time.monotonic() + settings.lease_renew_seconds
    while True:
        with session_scope(settings.database_url) as session:
            formed = form(session, job_id, settings.lease_seconds)
        with session_scope(settings.database_url) as session:
            gang = place(session, job_id, member.slot)
            if gang is not None:
                log.info("job %s: gang formed, node %d of %d, rendezvous %s", job_id, gang.node, gang.nodes,
                         gang.endpoint)  # fmt: skip
                return job_id, gang
            mine = session.execute(select(JobNode.node).where(JobNode.job_id == job_id,
                                                              JobNode.slot == member.slot)).one_or_none()  # fmt: skip
            job = session.execute(select(Job.status, Job.enqueued_at, Job.waiting_reason)
                                  .where(Job.id == job_id)).one()  # fmt: skip
            if mine is None or job.status != JobStatus.queued.value:  # cancelled, or formed without this slot
                release(session, job_id, member.slot)
                return None
            deadline = _deadline(session, job_id, settings.gang_wait_seconds)
            stopping = should_stop()
            expired = is_held(job) or (deadline is not None and utcnow() >= deadline)
            older = None if expired or formed else older_gang(session, job_id, member)
            if time.monotonic() >= renew_at:  # this slot's place, on the lease's own cadence
                renew_at = time.monotonic() + settings.lease_renew_seconds
                expires = utcnow() + timedelta(seconds=settings.lease_seconds)
                session.execute(update(JobNode).where(JobNode.job_id == job_id, JobNode.slot == member.slot)
                                .values(lease_expires_at=expires))  # fmt: skip
        if stopping:  # the worker stops: this slot's place goes, the gang waits for another
            with session_scope(settings.database_url) as session:
                if not leave(session, job_id, member.slot):
                    continue  # formed meanwhile: it runs, and the run stops as the slot does
            if not recruited:  # the message this slot took goes on
                send(settings, job_id)
            log.info("job %s: left its gang, the slot is stopping", job_id)
            return None
        if expired:
            with session_scope(settings.database_url) as session:
                if not let_go(session, job_id, member.slot, settings):
                    continue
            log.info("job %s: its gang did not form in %g s; let go", job_id, settings.gang_wait_seconds)
            return None
        if older is not None:
            with session_scope(settings.database_url) as session:
                if not leave(session, job_id, member.slot):
                    continue
            with session_scope(settings.database_url) as session:
                moved = join(session, older, member, settings.lease_seconds)
            if not recruited:  # the message this slot took goes on: its gang has one in flight again
                send(settings, job_id)
            log.info("job %s: left its gang for the older job %s's (%s)", job_id, older, moved)
            if moved == JOINED:
                job_id, recruited = older, True  # the older gang recruits already
                continue
            # Another member took the older gang's last place first (both saw room in it): back to this
            # slot's own gang, which would otherwise be left with no member and not held, so never let go.
            with session_scope(settings.database_url) as session:
                back = join(session, job_id, member, settings.lease_seconds)
            if back != JOINED:
                log.info("job %s: not joining its gang again (%s)", job_id, back)
                return None
            recruited = True  # its message went on above: the gang has one in flight
            continue
        if not recruited:
            send(settings, job_id)  # one message in flight for the next member
            recruited = True
        time.sleep(POLL_S)


# Stops every node sees asked for (the job's flags): rank 0's node records them, the others only stop.
USER_STOPS = frozenset({ErrorReason.cancelled, ErrorReason.paused})


def node_outcome(outcome: RunOutcome, asked: ErrorReason | None = None) -> RunOutcome | None:
    """How one node's run ending ends the job's attempt; None when it does not: a node without rank 0
    whose ranks all finished, or that stopped for a user's cancel or pause, leaves the end to rank 0's
    node, which saves the model and the job's log and records it. (A node whose worker stops requeues
    the job itself: the other nodes do not know.)

    ``asked``: a user's cancel or pause of the job, read once the run ended. A node whose peer stopped
    for it first fails on its broken collectives before its own poll sees the request: that run was
    stopped by the request, not lost (a cancelled gang was recorded failed, worker_lost)."""
    if outcome.status == JobStatus.failed and outcome.stopped_by is None and asked in USER_STOPS:
        outcome = replace(outcome, stopped_by=asked)
    other = bool(outcome.summary.get(OTHER_NODE))
    if other and (outcome.status == JobStatus.succeeded or outcome.stopped_by in USER_STOPS):
        return None
    if outcome.status != JobStatus.failed or outcome.reason == ErrorReason.out_of_memory:
        return outcome
    if outcome.stopped_by is not None:
        # Asked to stop (a cancel, a pause, its worker stopping), its ranks failed: torchrun exits non-zero
        # when its ranks are signalled, and a node stopping first breaks the others' collectives.
        return replace(outcome, status=JobStatus.cancelled, reason=outcome.stopped_by)
    if outcome.reason == ErrorReason.internal:
        # A node's run fails when a peer's does (its collectives break): the gang restarts, spending one
        # restart, as torchrun's --max-restarts restarts the whole gang on any rank's failure.
        return replace(outcome, reason=ErrorReason.worker_lost)
    return outcome


def renew_node_lease(session: Session, job_id: str, attempt: int, slot: str, lease_s: float) -> bool:
    """Renew this node's lease; the job's lease becomes the earliest of its nodes'. False when fenced out."""
    expires = utcnow() + timedelta(seconds=lease_s)
    session.execute(update(JobNode).where(JobNode.job_id == job_id, JobNode.slot == slot, JobNode.attempt == attempt)
                    .values(lease_expires_at=expires))  # fmt: skip
    earliest = (select(func.min(JobNode.lease_expires_at))
                .where(JobNode.job_id == job_id, JobNode.attempt == attempt).scalar_subquery())  # fmt: skip
    result = session.execute(update(Job).where(Job.id == job_id, *fence(attempt)).values(lease_expires_at=earliest))
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def resend_gangs(settings: Settings, queues: Sequence[str] | None = None) -> list[str]:
    """Send held multi-node jobs again, oldest first, where enough workers of their queue have a free slot."""
    from service_core.queue import send_once

    held = (Job.status == JobStatus.queued.value, Job.nodes > 1, Job.enqueued_at.is_(None),
            Job.waiting_reason.is_not(None))  # fmt: skip
    picked: list[tuple[str, str, int]] = []
    with session_scope(settings.database_url) as session:
        where = [*held] if queues is None else [*held, Job.queue.in_(sorted(queues))]
        jobs = session.execute(select(Job.id, Job.queue, Job.priority, Job.nodes).where(*where)
                               .order_by(Job.priority.desc(), Job.created_at)).all()  # fmt: skip
        free: dict[str, int] = {}
        for job_id, queue, priority, nodes in jobs:
            if queue not in free:
                free[queue] = free_workers(session, queue, settings.lease_seconds)[0]
            if free[queue] >= nodes:
                free[queue] -= nodes
                picked.append((job_id, queue, priority))
    sent = [job_id for job_id, queue, priority in picked
            if send_once(settings, job_id, queue, priority, held, {"enqueued_at": utcnow()})]  # fmt: skip
    if sent:
        log.info("sent %d multi-node jobs again, their queues have free workers: %s", len(sent), sent)
    return sent


def busy_slot_pids(session: Session, host: str, pids: Sequence[int]) -> set[int]:
    """Of ``pids`` (slots of ``host``), those in a gang, forming or running."""
    rows = session.execute(select(JobNode.pid).where(JobNode.host == host, JobNode.pid.in_(list(pids)))).scalars()
    return set(rows)
