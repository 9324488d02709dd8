"""A job across two worker hosts (worker/gang.py): one slot of each joins its gang, the nodes meet on
torchrun's c10d rendezvous at node 0's advertised address, and the run trains as one node with two
processes does. Cancel stops both nodes; a node's host lost restarts the gang (a sharded one) from the
store's checkpoint once a replacement host joins, with exact steps."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import httpx
import pytest

from tests.worker.test_service_e2e import poll_metrics
from worker.procfs import cmdline, parent_of
from worker.zygote import MARKER as ZYGOTE_MARKER

from .netns import Host
from .stack import TERMINAL, Fleet, dataset_spec, wait_for

pytestmark = pytest.mark.slow
# 64 rows, 8 a process and 2 processes: 4 steps an epoch.
STEPS_PER_EPOCH = 4


def submit(fleet: Fleet, spec: dict[str, Any], queue: str, **resources: int) -> str:
    with fleet.client() as client:
        created = client.post("/v1/jobs", json={**spec, "resources": resources, "queue": queue})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def losses(client: httpx.Client, job_id: str) -> list[tuple[int, float]]:
    return [(p["step"], p["value"]) for p in poll_metrics(client, job_id, 120) if p["name"] == "loss"]


def node_logs(client: httpx.Client, job_id: str) -> list[str]:
    """Each node's own log (empty until its part ended)."""
    return [client.get(f"/v1/jobs/{job_id}/logs", params={"node": node}).json()["text"] for node in (0, 1)]


def runs_on(fleet: Fleet, name: str) -> list[int]:
    """The training processes alive on host ``name``: runs started as new interpreters, and runs forked
    from a slot's zygote with their launchers and ranks, which show the zygote's command line under a
    parent on the host that shows it too. The zygote's own parent is its slot, or the suite's zygote
    parent, off the host (tests/shared_servers.py), whose command line shows the marker as well."""
    host = next(host for host in fleet.worker_hosts if host.name == name)
    marker = ZYGOTE_MARKER.encode()
    pids = host.pids()

    def forked(pid: int) -> bool:
        parent = parent_of(pid)
        return marker in cmdline(pid) and parent in pids and marker in cmdline(parent or 0)

    return [pid for pid in pids if b"trainer_core" in cmdline(pid) or forked(pid)]


def listens_on(host: Host, port: int) -> bool:
    """Whether a process of ``host`` listens on TCP ``port``."""
    listening = subprocess.run(["ip", "netns", "exec", host.netns, "ss", "-Hltn", f"sport = :{port}"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    return bool(listening.strip())


def test_a_two_node_job_trains_as_one_node_of_two_processes_and_a_cancel_stops_both(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str
) -> None:
    fleet = fleet_stack
    fleet.start_workers(fleet.worker_hosts, queue)
    spec = dataset_spec(sentiment_dataset, num_train_epochs=2, logging_steps=1, seed=7)
    two_nodes = submit(fleet, spec, queue, num_nodes=2, num_processes=1)
    one_node = submit(fleet, spec, queue, num_processes=2)
    wait_for("both jobs to end", lambda: {fleet.job(j).status for j in (two_nodes, one_node)} <= TERMINAL, timeout=300)
    for job_id in (two_nodes, one_node):
        job = fleet.job(job_id)
        assert (job.status, job.progress_step) == ("succeeded", 2 * STEPS_PER_EPOCH), job.error_message
    started = [data for data in fleet.statuses(two_nodes) if data["status"] == "running"]
    hosts = sorted(host.name for host in fleet.worker_hosts)
    assert len(started) == 1 and sorted(started[0]["message"].removeprefix("2 nodes: ").split(", ")) == hosts
    with fleet.client() as client:
        gang, single = losses(client, two_nodes), losses(client, one_node)
        assert [step for step, _ in gang] == [step for step, _ in single] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
        # the same world, batch and seed: the same run
        assert [loss for _, loss in gang] == pytest.approx([loss for _, loss in single], rel=1e-5)
        # Each node's own log is kept once its part ended (the other node's may end after the job's end
        # was recorded); a node the job does not have is refused, naming the field.
        wait_for("both nodes' logs", lambda: all(node_logs(client, two_nodes)), timeout=60)
        logs = node_logs(client, two_nodes)
        assert logs[0] != logs[1], logs  # each node's own run's output
        missing = client.get(f"/v1/jobs/{two_nodes}/logs", params={"node": 2})
        assert missing.status_code == 422 and missing.json()["errors"][0]["field"] == "node"

        long = submit(fleet, {**spec, "training": {**spec["training"], "num_train_epochs": 200}}, queue,
                      num_nodes=2, num_processes=1)  # fmt: skip
        wait_for("the long job to train", lambda: fleet.job(long).progress_step >= 2, timeout=240)
        assert all(runs_on(fleet, name) for name in hosts)
        nodes = client.get(f"/v1/jobs/{long}").json()["nodes"]
        assert sorted((n["node"], n["host"]) for n in nodes) in ([(0, hosts[0]), (1, hosts[1])],
                                                                 [(0, hosts[1]), (1, hosts[0])]), nodes  # fmt: skip
        # node 0's address is its host's on the bridge, and its run serves the rendezvous at its port
        first = next(n for n in nodes if n["node"] == 0)
        host_of = {host.name: host for host in fleet.worker_hosts}
        assert first["address"] == host_of[first["host"]].address
        assert listens_on(host_of[first["host"]], first["port"])
        assert client.post(f"/v1/jobs/{long}/cancel").status_code == 202
    wait_for("the cancel", lambda: fleet.job(long).status in TERMINAL, timeout=120)
    assert fleet.job(long).status == "cancelled"
    wait_for("both nodes' runs to stop", lambda: not any(runs_on(fleet, name) for name in hosts), timeout=60)
    # The job's own log is its rank 0 node's: the other node, stopped too, did not store over it.
    with fleet.client() as client:
        wait_for("both nodes' logs", lambda: all(node_logs(client, long)), timeout=60)
        assert client.get(f"/v1/jobs/{long}/logs").json()["text"] in node_logs(client, long)


def test_a_lost_node_restarts_the_sharded_gang_from_the_store_with_exact_steps(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str
) -> None:
    """Sharded (FSDP) over the two nodes: rank 0 gathers each checkpoint whole, so the store's is complete."""
    fleet = fleet_stack
    fleet.start_workers(fleet.worker_hosts, queue)
    epochs = 24
    total = epochs * STEPS_PER_EPOCH
    spec = dataset_spec(sentiment_dataset, num_train_epochs=epochs, logging_steps=1, save_steps=8, backend="accelerate")
    spec["efficiency"] = {**spec.get("efficiency", {}), "sharding": "fsdp"}
    job_id = submit(fleet, spec, queue, num_nodes=2, num_processes=1)
    lost = fleet.worker_hosts[0]
    with fleet.held_at_a_checkpoint(job_id):
        wait_for("a checkpoint in the store", lambda: fleet.stored_checkpoints(job_id) != [], timeout=240)
        stored = fleet.stored_checkpoints(job_id)[-1]
        assert fleet.job(job_id).progress_step < total
        lost.lose()  # the other node's run goes on as the block ends, and finds its peer gone
    wait_for("the gang's attempt to end", lambda: fleet.job(job_id).status != "running", timeout=60)
    # A replacement machine, empty disk, joins the queue: the gang forms again with it.
    lost.fresh_disk()
    fleet.start_workers([lost], queue)
    wait_for("the job to end", lambda: fleet.job(job_id).status in TERMINAL, timeout=300)
    job = fleet.job(job_id)
    assert (job.status, job.attempts, job.progress_step) == ("succeeded", 2, total), job.error_message
    with fleet.client() as client:
        assert [step for step, _ in losses(client, job_id)] == list(range(1, total + 1))
    requeues = [data for data in fleet.statuses(job_id) if data["status"] == "queued"]
    assert len(requeues) == 1 and requeues[0]["reason"] == "worker_lost", requeues
    resumed = re.search(r"from checkpoint-(\d+)", str(requeues[0]["message"]))
    assert resumed is not None and int(resumed.group(1)) >= stored, requeues
