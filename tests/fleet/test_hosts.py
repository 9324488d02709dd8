"""The harness itself: a host has its own hostname and network, reaches the shared servers only through
the bridge, and what a crashed run left behind is removed by the next one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.worker.test_recovery import dead_pid

from .netns import PREFIX, ip, netns_unavailable, remove_leftovers
from .stack import Fleet

pytestmark = pytest.mark.slow
PROBE = """
import socket, sys
def reaches(host, port):
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return "yes"
    except OSError:
        return "no"
print(socket.gethostname(), reaches("127.0.0.1", 5432), reaches(sys.argv[1], sys.argv[2]))
"""


def test_a_host_has_its_own_name_and_reaches_the_database_only_through_the_bridge(fleet_stack: Fleet) -> None:
    host = fleet_stack.worker_hosts[0]
    database = fleet_stack.env["DATABASE_URL"].split("@")[1].split("/")[0]  # the forwarder on the bridge
    log = fleet_stack.log(host, "probe")
    probe = host.spawn([sys.executable, "-c", PROBE, *database.split(":")], {"PATH": os.environ["PATH"]}, log)
    assert probe.wait(30) == 0, log.read_text()
    # The machine's PostgreSQL listens on 127.0.0.1 of the root namespace: not this host's loopback.
    assert log.read_text().split() == [host.name, "no", "yes"]


def test_leftovers_of_a_crashed_run_are_removed_those_of_a_live_one_kept() -> None:
    if why := netns_unavailable():
        pytest.skip(f"no network namespaces: {why}")
    running = subprocess.Popen(["sleep", "60"])  # stands for another test run, still going
    crashed, live = f"{PREFIX}{dead_pid()}", f"{PREFIX}{running.pid}"
    try:
        for tag in (crashed, live):
            ip("netns", "add", f"{tag}-worker-a")
            ip("link", "add", f"{tag}br", "type", "bridge")
        remove_leftovers()
        namespaces, links = ip("netns", "list"), ip("-o", "link", "show")
        assert f"{crashed}-worker-a" not in namespaces and f"{crashed}br:" not in links
        assert f"{live}-worker-a" in namespaces and f"{live}br:" in links
    finally:
        for tag in (crashed, live):
            ip("netns", "del", f"{tag}-worker-a", check=False)
            ip("link", "del", f"{tag}br", check=False)
        running.kill()
        running.wait()
