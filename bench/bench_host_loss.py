"""Host loss: how long from a worker host lost mid-job to the job running again on the other host.

    .venv/bin/python bench/bench_host_loss.py [--rounds 3] [--faults lose,cut] [--lease 4] [--sweep 1]

Runs on the fleet of the tests (tests/fleet/: an API host and two worker hosts in network
namespaces, PostgreSQL + Redis + SeaweedFS through the bridge; needs root). Each round starts both
workers on a fresh queue, submits a 96-step job through the API host (a checkpoint every 10 steps),
waits for its first checkpoint in the store, then loses the host running it:

- ``lose``: every process of the host SIGKILLed and its disk deleted;
- ``cut``: its link set down (its processes live on, cut off) until the job runs elsewhere.

From the job's status events (times the database stored) it reports the loss -> requeued (the lease
running out and a sweep noticing), -> running on the other host (claimed; the checkpoint fetched from
the store next) and -> first new step (training again). Goal: loss -> running <= lease + 2 sweeps +
30 s (PASS/MISS). Each round also checks the job: succeeded on the other host in 2 attempts with one
loss point per step, or the round is marked WRONG.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import select

from service_core.db import JobEvent
from service_core.db.session import session_scope
from tests.fleet.netns import netns_unavailable
from tests.fleet.stack import TERMINAL, Fleet, dataset_spec, fleet, new_queue, upload_csv, wait_for
from tests.trainer_core.datagen import write_sentiment_csv
from tests.worker.test_service_e2e import poll_metrics

EPOCHS, STEPS_PER_EPOCH = 12, 8  # 64 rows in batches of 8
SLACK_S = 30.0


def event_times(fleet_: Fleet, job_id: str) -> list[tuple[str, dict[str, Any], datetime]]:
    with session_scope(fleet_.database_url) as session:
        query = select(JobEvent.kind, JobEvent.data, JobEvent.time).where(JobEvent.job_id == job_id)
        return [(kind, dict(data), at) for kind, data, at in session.execute(query.order_by(JobEvent.seq))]


def one_round(fleet_: Fleet, dataset_id: str, fault: str) -> dict[str, Any]:
    """One job, one host lost mid-run; the spans from the loss, and whether the job came out right."""
    queue = new_queue()
    try:
        fleet_.start_workers(fleet_.worker_hosts, queue)
        spec = dataset_spec(dataset_id, num_train_epochs=EPOCHS, logging_steps=1, save_steps=10)
        with fleet_.client() as client:
            job_id = client.post("/v1/jobs", json={**spec, "queue": queue}).json()["id"]
        wait_for("a checkpoint in the store", lambda: fleet_.stored_checkpoints(job_id) != [], timeout=300)
        lost = fleet_.host_running(job_id)
        assert lost is not None, "the job ended before its host could be lost"
        other = next(host for host in fleet_.worker_hosts if host is not lost)
        lost_at = datetime.now(UTC)
        if fault == "lose":
            lost.lose()
        else:
            lost.cut()
        wait_for("the job to run elsewhere", lambda: fleet_.host_running(job_id) is other, timeout=300)
        lost.reconnect()
        wait_for("the job to end", lambda: fleet_.job(job_id).status in TERMINAL, timeout=600)
        with fleet_.client() as client:
            steps = [p["step"] for p in poll_metrics(client, job_id, 60) if p["name"] == "loss"]
        job = fleet_.job(job_id)
        right = (job.status, job.attempts, job.worker) == ("succeeded", 2, other.name) and steps == list(
            range(1, EPOCHS * STEPS_PER_EPOCH + 1)
        )
        return {"fault": fault, "right": right, **spans(event_times(fleet_, job_id), lost_at)}
    finally:
        fleet_.stop_workers(queue)


def spans(events: list[tuple[str, dict[str, Any], datetime]], lost_at: datetime) -> dict[str, float]:
    """Seconds from the loss to the requeue, to the second attempt's ``running``, to its first step."""
    lost = lost_at.replace(tzinfo=None) if events and events[0][2].tzinfo is None else lost_at
    requeued = next(at for kind, data, at in events if kind == "status" and data["status"] == "queued")
    running = next(at for kind, data, at in events if kind == "status" and data["status"] == "running"
                   and at > requeued)  # fmt: skip
    stepped = next(at for kind, _data, at in events if kind == "metric" and at > running)
    return {name: (at - lost).total_seconds() for name, at in
            (("requeued", requeued), ("running", running), ("training", stepped))}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fault")
    parser.add_argument("--faults", default="lose,cut", help="comma-separated: lose, cut")
    parser.add_argument("--lease", type=float, default=4.0, help="TRAINJOBS_LEASE_SECONDS")
    parser.add_argument("--sweep", type=float, default=1.0, help="TRAINJOBS_SWEEP_SECONDS")
    args = parser.parse_args()
    if why := netns_unavailable():
        print(f"cannot build the fleet: {why}")
        return 2
    leases = {
        "TRAINJOBS_LEASE_SECONDS": str(args.lease),
        "TRAINJOBS_LEASE_RENEW_SECONDS": str(args.lease / 8),
        "TRAINJOBS_SWEEP_SECONDS": str(args.sweep),
        "TRAINJOBS_REDELIVER_AFTER_SECONDS": str(2 * args.sweep),
    }
    goal = args.lease + 2 * args.sweep + SLACK_S
    faults = [fault.strip() for fault in args.faults.split(",") if fault.strip()]
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-host-loss-") as tmp, fleet(Path(tmp), leases=leases) as running:
        csv = Path(write_sentiment_csv(Path(tmp) / "data", n_train=64, n_val=8)["train"])
        with running.client() as client:
            dataset_id = str(upload_csv(client, csv)["id"])
        for index in range(args.rounds):
            for fault in faults:
                result = one_round(running, dataset_id, fault)
                results.append(result)
                print(f"round {index + 1} {fault}: requeued {result['requeued']:.1f} s, running "
                      f"{result['running']:.1f} s, training {result['training']:.1f} s, "
                      f"{'right' if result['right'] else 'WRONG'}", flush=True)  # fmt: skip
    print(f"\nlease {args.lease:g} s, sweep {args.sweep:g} s: goal loss -> running <= {goal:g} s; "
          f"{args.rounds} rounds per fault, {time.monotonic() - started:.0f} s in all")  # fmt: skip
    print("| fault | loss -> requeued (s) | loss -> running elsewhere (s) | loss -> training (s) | worst running | "
          "goal | right |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for fault in faults:
        rows = [r for r in results if r["fault"] == fault]
        worst = max(r["running"] for r in rows)
        medians = [statistics.median(r[key] for r in rows) for key in ("requeued", "running", "training")]
        print(f"| {fault} | {medians[0]:.1f} | {medians[1]:.1f} | {medians[2]:.1f} | {worst:.1f} | "
              f"{'PASS' if worst <= goal else 'MISS'} | {sum(r['right'] for r in rows)}/{len(rows)} |")  # fmt: skip
    return 0 if all(r["right"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
