"""Hosts on one machine: a Linux network namespace per host, each with a veth pair on one bridge.

A host has its own network stack (its own loopback and ports, one address on the bridge's private
/24 and no route anywhere else), its own hostname (a UTS namespace per process it starts: jobs record
``socket.gethostname()`` as the host running them), and its own folder as its disk. Losing a host is
SIGKILLing every process in its namespace and deleting its disk; cutting it off is setting its veth
down. Everything is named ``tjf<pid>...``, so a later run removes what a crashed one left behind
(only runs whose process is gone: two runs at once leave each other alone).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.procfs import is_alive

PREFIX = "tjf"
_OWNED = re.compile(rf"^{PREFIX}(\d+)")


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS`` (iproute2) and return its output; raises with its stderr when ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can): the tests skip with it."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the fleet tests as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    ip("netns", "del", probe, check=False)
    return None


def namespace_pids(netns: str) -> list[int]:
    """Every process in network namespace ``netns`` (``ip netns pids``)."""
    return [int(pid) for pid in ip("netns", "pids", netns, check=False).split()]


def kill_namespace(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` until none is left (a dying parent may still fork)."""
    deadline = time.monotonic() + timeout_s
    while pids := [pid for pid in namespace_pids(netns) if is_alive(pid)]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of namespace {netns} survive SIGKILL")
        time.sleep(0.05)


def remove_leftovers() -> None:
    """Delete namespaces and links of earlier runs whose process is gone (a crashed or killed run)."""
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if (owned := _OWNED.match(name)) and not is_alive(int(owned.group(1))):
            kill_namespace(name)
            ip("netns", "del", name, check=False)
    for line in ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if (owned := _OWNED.match(name)) and not is_alive(int(owned.group(1))):
            ip("link", "del", name, check=False)


def free_subnet() -> ipaddress.IPv4Network:
    """A private /24 (10.231.n.0/24) that no interface of this machine uses yet."""
    used = ip("-o", "-4", "addr", "show")
    start = os.getpid() % 250
    for offset in range(250):
        net = ipaddress.IPv4Network(f"10.231.{(start + offset) % 250 + 1}.0/24")
        if f" {net.network_address + 1}/" not in used and not any(f" {h}/" in used for h in list(net.hosts())[:8]):
            return net
    raise RuntimeError("no free 10.231.n.0/24 subnet")


@dataclass
class Host:
    """One machine: a namespace, its address on the bridge, its hostname and its disk."""

    name: str  # the hostname its processes see
    netns: str
    veth: str  # the bridge-side end of its link: down means the host is cut off
    address: str
    disk: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, args: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``args`` on this host: in its namespace, under its hostname, output to ``log``."""
        # `unshare --uts` gives the process (and everything it starts) a hostname of its own; the
        # shell sets it and execs, so the Popen pid is the program itself.
        command = ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                   'hostname "$0" && exec "$@"', self.name, *args]  # fmt: skip
        with log.open("ab") as out:
            proc = subprocess.Popen(command, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        self.processes.append(proc)
        return proc

    def pids(self) -> list[int]:
        return [pid for pid in namespace_pids(self.netns) if is_alive(pid)]

    def kill_all(self) -> None:
        """Every process of this host dies at once (SIGKILL), as when it loses power."""
        kill_namespace(self.netns)
        for proc in self.processes:
            proc.wait()
        self.processes.clear()

    def lose(self) -> None:
        """The host is gone for good: its processes killed, its local disk deleted."""
        self.kill_all()
        shutil.rmtree(self.disk, ignore_errors=True)

    def cut(self) -> None:
        """Unplug its network cable: packets to and from it are dropped, its processes live on."""
        ip("link", "set", self.veth, "down")

    def reconnect(self) -> None:
        ip("link", "set", self.veth, "up")

    def fresh_disk(self) -> None:
        """An empty disk (a replaced machine), with the folder its processes run from."""
        shutil.rmtree(self.disk, ignore_errors=True)
        self.disk.mkdir(parents=True)


@dataclass
class Network:
    """A bridge with the first address of a free /24 and one namespace per host behind it."""

    root: Path
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    subnet: ipaddress.IPv4Network = field(default_factory=free_subnet)
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def gateway(self) -> str:
        """The bridge's address: where the servers of the root namespace listen for the hosts."""
        return str(self.subnet.network_address + 1)

    def __enter__(self) -> Network:
        remove_leftovers()
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (``<tag>-<name>`` as its hostname) with the next address of the subnet."""
        index = len(self.hosts) + 1
        host = Host(name=f"{self.tag}-{name}", netns=f"{self.tag}-{name}", veth=f"{self.tag}v{index}",
                    address=str(self.subnet.network_address + 1 + index), disk=self.root / name)  # fmt: skip
        self.hosts[name] = host
        peer = f"{host.veth}p"
        ip("netns", "add", host.netns)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", host.netns)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        inside = ("netns", "exec", host.netns, "ip")
        ip(*inside, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", peer)
        ip(*inside, "link", "set", peer, "up")
        ip(*inside, "link", "set", "lo", "up")
        host.fresh_disk()
        return host

    def kill_all(self) -> None:
        """Every process of every host dies."""
        for host in self.hosts.values():
            with contextlib.suppress(RuntimeError):
                host.kill_all()

    def close(self) -> None:
        """Kill every host's processes, delete the namespaces (their veths go with them) and the bridge."""
        self.kill_all()
        for host in self.hosts.values():
            ip("netns", "del", host.netns, check=False)
            ip("link", "del", host.veth, check=False)
        ip("link", "del", self.bridge, check=False)
