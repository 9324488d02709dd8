"""Which hosts a job's data URLs may reach: public ones only. The one rule for the API's check at submit
(api/paths.py) and the run's check at fetch time (trainer_core/data/loading.py).

A name can resolve to a public address when the API checks it and to an internal one when the run
fetches (DNS rebinding, or a worker whose resolver knows internal names the API host does not). So
the run checks again when it fetches: it resolves each URL host itself and refuses a non-public
answer before any request, and while ``datasets`` fetches, every resolution of those hosts by the
fetching client goes through the same check (:func:`guarded_resolution`).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

# Cloud metadata services by name (they answer at link-local addresses that the worker's resolver
# may know while the API host cannot resolve them): credentials live there.
METADATA_HOSTS = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
     "metadata.azure.com", "metadata.packet.net", "metadata.platformequinix.com", "169.254.169.254.nip.io"}
)  # fmt: skip
# Suffixes that only name hosts on a private network (RFC 6761/6762/8375 and cluster DNS).
INTERNAL_SUFFIXES = (".internal", ".local", ".localdomain", ".lan", ".home.arpa", ".svc", ".cluster.local", ".intranet")


class ForbiddenAddress(OSError):
    """A data URL's host resolved to (or is) an address a job must not reach."""


def normalized(host: str) -> str:
    return host.strip("[]").lower().rstrip(".")


def name_problem(host: str) -> str | None:
    """Why ``host``, by its name alone, must not be fetched (this machine, metadata, internal), or None."""
    name = normalized(host)
    if not name:
        return "has no host"
    if name == "localhost" or name.endswith(".localhost"):
        return "points at this machine"
    if name in METADATA_HOSTS:
        return "is a cloud metadata service"
    if name.endswith(INTERNAL_SUFFIXES):
        return "is a private network name"
    if "." not in name and ":" not in name and not name.isdigit():
        # A single label is resolved through the worker's search domains: an internal service.
        return "is a single-label (internal) name; use a fully qualified public host"
    return None


def ip_problem(address: str) -> str | None:
    """Why an IP address must not be reached (loopback, private, link-local, reserved...), or None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global or ip.is_multicast:
        return f"resolves to the non-public address {ip}"
    return None


def _answers_problem(infos: list[Any]) -> str | None:
    for info in infos:
        if problem := ip_problem(str(info[4][0])):
            return problem
    return None


def host_problem(host: str, *, resolve: Callable[..., list[Any]] | None = None) -> str | None:
    """Why ``host`` must not be fetched: its name, or any address it resolves to now; None if public.

    A name that does not resolve here is None: the fetch fails the same way, reaching nothing.
    """
    if problem := name_problem(host):
        return problem
    name = normalized(host)
    try:
        return ip_problem(name)  # an address literal
    except ValueError:
        pass
    try:
        infos = (resolve or socket.getaddrinfo)(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    return _answers_problem(infos)


@contextmanager
def guarded_resolution(hosts: Collection[str]) -> Iterator[list[str]]:
    """While open, a resolution of one of ``hosts`` in this process that answers a non-public address
    raises :class:`ForbiddenAddress` instead of returning it, so no client connects there. Yields the
    list of refusals (empty when none), for the caller to name the cause of a failed fetch.
    """
    guarded = {normalized(h) for h in hosts}
    refused: list[str] = []
    real = socket.getaddrinfo

    def checked(host: Any, *args: Any, **kwargs: Any) -> list[Any]:
        infos = real(host, *args, **kwargs)
        name = normalized(host.decode() if isinstance(host, bytes) else str(host or ""))
        if name in guarded and (problem := _answers_problem(infos)):
            refused.append(f"{name} {problem}")
            raise ForbiddenAddress(f"refused to connect: {name} {problem}")
        return infos

    socket.getaddrinfo = checked  # type: ignore[assignment]
    try:
        yield refused
    finally:
        socket.getaddrinfo = real  # type: ignore[assignment]
