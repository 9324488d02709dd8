"""Data URLs are checked again when the run fetches them (trainer_core/net_guard.py): a host that
resolves to an internal address at that moment (DNS rebinding) is refused before any request, with a
data error naming the field. A real HTTP server on 127.0.0.1 counts the requests that reach it.

DNS is the environment here, not the code under test: ``socket.getaddrinfo`` answers chosen
addresses for made-up names (as a rebinding resolver would), and passes every other name through.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from trainer_core.data.loading import load_raw
from trainer_core.net_guard import ForbiddenAddress, guarded_resolution, host_problem
from trainer_core.spec import JobSpec, SpecError

from .datagen import tiny_text_spec

CSV = b"text,label\ngood film,1\nbad film,0\n"


class Server:
    def __init__(self) -> None:
        self.requests: list[str] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(CSV)))
                self.end_headers()
                self.wfile.write(CSV)

            do_HEAD = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    thread = threading.Thread(target=srv.httpd.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> None:
    """Resolve each name in ``answers`` to its next address (the last one repeats); others as usual."""
    real: Callable[..., list[Any]] = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        queue = answers.get(str(host))
        if queue is None:
            return real(host, port, *args, **kwargs)
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        return real(address, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def url_spec(url: str) -> JobSpec:
    spec = tiny_text_spec({"train": "unused.csv"})
    spec["dataset"]["data_files"] = {"train": url}
    return JobSpec.model_validate(spec)


def test_a_name_that_rebinds_to_loopback_is_refused_at_fetch_time(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Public when the API checked it at submit, this machine when the run fetches.
    fake_dns(monkeypatch, {"data.example.com": ["93.184.216.34", "127.0.0.1"]})
    assert host_problem("data.example.com") is None  # the submit's check (api/paths.py) passes
    with pytest.raises(SpecError) as refused:
        load_raw(url_spec(f"http://data.example.com:{server.port}/train.csv"))
    error = refused.value.errors[0]
    assert error.field == "dataset.data_files.train"
    assert "127.0.0.1" in error.message and "fetch time" in error.message
    assert server.requests == []


@pytest.mark.parametrize("host", ["localhost", "metadata.google.internal", "169.254.169.254", "[::ffff:127.0.0.1]"])
def test_internal_names_and_addresses_are_refused_at_fetch_time(server: Server, host: str) -> None:
    with pytest.raises(SpecError) as refused:
        load_raw(url_spec(f"http://{host}:{server.port}/train.csv"))
    assert refused.value.errors[0].field == "dataset.data_files.train"
    assert server.requests == []


def test_the_fetching_clients_own_resolution_is_checked(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the run's check and the client's own lookup the answer may change: the client's lookup of
    a guarded host is checked too, so no connection is made. An unguarded name reaches the server (the
    server is reachable: the guard is what stops the first request)."""
    fake_dns(monkeypatch, {"data.example.com": ["127.0.0.1"], "other.example.net": ["127.0.0.1"]})
    with guarded_resolution({"data.example.com"}) as refusals:
        with pytest.raises(urllib.error.URLError) as failed:
            urllib.request.urlopen(f"http://data.example.com:{server.port}/train.csv", timeout=10)
        assert isinstance(failed.value.reason, ForbiddenAddress)
        assert server.requests == []
        with urllib.request.urlopen(f"http://other.example.net:{server.port}/train.csv", timeout=10) as answer:
            assert answer.read() == CSV
    assert refusals == ["data.example.com resolves to the non-public address 127.0.0.1"]
    assert server.requests == ["/train.csv"]
    assert socket.getaddrinfo.__name__ == "resolve"  # the guard put back what it found
