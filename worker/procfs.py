"""Reading ``/proc``: the one module that does, for the worker, the benches and the tests.

Why not psutil: the worker runs only on Linux (it relies on ``PR_SET_PDEATHSIG`` and process groups),
what it needs is a handful of fields (state, parent, process group, command line, environment, one
``status`` line), and psutil would add a compiled dependency to every worker and the client-side
tests for them; it also has no process group (``os.getpgid`` answers only for live processes,
while the sweep must see a zombie's). Reading the files is a few lines each, tested on every run.

``/proc/PID/stat``'s second field (the command name) is in parentheses and may itself hold spaces
and ``)``, so the fields are split after its *last* ``)``; what follows starts with the state (``R``, ``S``, ``T``,
``Z``...), then the parent pid and the process group (proc(5)).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GONE = ("Z", "X")  # a zombie has ended: only its status waits for a reaper


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` the project reads."""

    pid: int
    state: str
    ppid: int
    pgid: int
    cpu_ticks: int  # user + system time, in clock ticks
    started: int  # clock ticks after boot: with the pid, it names one process (pids are reused)

    @property
    def alive(self) -> bool:
        return self.state not in GONE


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s stat fields, or None when there is no such process (or it vanished while read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]),
                        int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """``pid``'s state letter (``T`` stopped, ``Z`` zombie...), or None when it does not exist."""
    stat = proc_stat(pid)
    return stat.state if stat is not None else None


def is_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    stat = proc_stat(pid) if pid else None
    return stat is not None and stat.alive


def parent_of(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat.ppid if stat is not None else None


def children_of(pid: int) -> set[int]:
    """The pids of ``pid``'s children, from the kernel (``/proc/PID/task/PID/children``)."""
    return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def all_processes() -> Iterator[ProcStat]:
    """Every process's stat, skipping those that end while the listing is read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            yield stat


def cmdline(pid: int) -> bytes:
    """``pid``'s command line (NUL-separated), empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def processes_mentioning(marker: str) -> list[int]:
    """Live pids (not this one) whose command line contains ``marker`` (a home path, a queue name)."""
    needle, me = marker.encode(), os.getpid()
    return [p.pid for p in all_processes() if p.pid != me and p.alive and needle in cmdline(p.pid)]


def environ(pid: int) -> dict[str, str]:
    """``pid``'s environment as it started (``/proc/PID/environ``); empty when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def status_field(pid: int, name: str) -> str | None:
    """One line's value of ``/proc/PID/status`` (``VmRSS`` -> ``"123 kB"``, ``SigCgt`` -> a hex mask)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(f"{name}:")), None)


def machine_cpu_ticks() -> tuple[int, int]:
    """The machine's CPU time since boot, all cores, in clock ticks: (busy, total). Busy is all but
    idle and I/O wait (``/proc/stat``'s first line)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(values[:8])  # guest time is already counted in user and nice
    return total - values[3] - values[4], total


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and ``bind(0)`` (``ip_local_port_range``);
    Linux's default where it cannot be read."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
