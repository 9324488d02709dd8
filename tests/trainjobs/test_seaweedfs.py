"""The SeaweedFS store of ``trainjobs dev --s3`` and of the suite starts even when a port it picked is
taken before ``weed`` binds it (seen in the suite: three test processes starting their stores at once);
the ports picked for servers come from outside the range outgoing connections take theirs from."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainjobs import seaweedfs
from trainjobs.seaweedfs import SeaweedFS
from worker.procfs import ephemeral_ports

REPO = Path(__file__).resolve().parents[2]


def test_a_port_taken_before_weed_binds_it_is_given_up_for_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:  # fmt: skip
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = int(holder.getsockname()[1])
        # The first port picked (the S3 gateway's) is one another process holds by the time weed binds it.
        picks = iter([taken])
        real = seaweedfs.free_port
        monkeypatch.setattr(seaweedfs, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
        with SeaweedFS(data_dir=tmp_path / "weed") as store:
            assert store.s3_port != taken
            fs = store_fs(store)
            fs.pipe_file(f"{store.bucket}/probe.txt", b"ok")
            assert fs.cat_file(f"{store.bucket}/probe.txt") == b"ok"
    said = (tmp_path / "weed" / "weed.log").read_bytes()
    assert f"port {taken} ".encode() in said and any(marker in said for marker in seaweedfs.PORT_TAKEN)


def test_free_ports_are_outside_the_ephemeral_range_free_and_never_handed_out_twice() -> None:
    low, high = ephemeral_ports()
    ports = [seaweedfs.free_port() for _ in range(100)]
    # Another process picking meanwhile (another test's server starting) gets none of them.
    other = subprocess.run([sys.executable, "-c", "from trainjobs.seaweedfs import free_port\n"
                            "print(*(free_port() for _ in range(100)))"],
                           capture_output=True, text=True, check=True, cwd=REPO)  # fmt: skip
    ports += [int(port) for port in other.stdout.split()]
    assert len(ports) == len(set(ports)) == 200
    assert all(seaweedfs.PORTS_FROM <= port < low for port in ports), (low, high, ports)
    for port in ports[:20]:  # free when handed out: a server binds it
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    # An outgoing connection's local port comes from [low, high]: never one of those handed out.
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        assert low <= client.getsockname()[1] <= high


def store_fs(store: SeaweedFS) -> Any:
    import fsspec

    return fsspec.filesystem("s3", key=store.access_key, secret=store.secret_key,
                             client_kwargs={"endpoint_url": store.endpoint}, skip_instance_cache=True)  # fmt: skip
