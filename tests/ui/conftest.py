"""Browser tests: a live ``trainjobs dev --example`` and headless Chromium driven by Playwright.

Chromium is the distribution's (``/usr/bin/chromium``; ``make test`` installs it when missing), not
Playwright's download, which is often unreachable. Every page a test opens fails the test on a
console error, an uncaught exception, or any request to a host other than 127.0.0.1 (those are
aborted, so a page that needs the internet shows it). Screenshots go to the test's tmp folder and
are copied to ``out/screenshots/`` in the repository for people to look at.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright import sync_api as playwright_sync

from tests.conftest import CALL_FAILED
from tests.trainjobs.live import REPO, trainjobs_argv
from tests.worker.live import free_port
from trainer_core.oom_fault import FAULT_OOM_ENV
from trainjobs.client import Client

CHROMIUM = os.environ.get("TRAINJOBS_CHROMIUM", "/usr/bin/chromium")
KEY = "tj_ui-test-admin-key"
SCREENSHOTS = REPO / "out" / "screenshots"
OOM_ABOVE = 16  # micro-batch size above which the dev service's runs fail with out of memory
PRICE = 2.5  # the dev service's default queue's price per device-hour


@dataclass
class DevService:
    url: str
    key: str
    home: Path
    process: subprocess.Popen[bytes]

    @property
    def data_root(self) -> Path:
        return self.home / "data"

    def client(self) -> Client:
        return Client(self.url, self.key)


# Package scope: the browser tests run as one unit on one xdist worker (tests/conftest.py), and the
# service and Playwright (whose event loop takes over the main thread's asyncio) end with the unit
# rather than living on under the tests the worker runs next.
@pytest.fixture(scope="package")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevService]:
    """``trainjobs dev --example`` on a free port with a temporary home (SQLite, embedded broker)."""
    home = tmp_path_factory.mktemp("ui") / "var"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT",
                                                                     "DATA_ROOT", "TRAINJOBS_ENV"))}  # fmt: skip
    env.update(TRAINJOBS_HOME=str(home), TRAINJOBS_API_KEY=KEY, TRAINJOBS_CANCEL_GRACE_SECONDS="5",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TRAINJOBS_QUEUE_PRICES=json.dumps({"default": PRICE}),
               # Testing aid: the webhook page's receiver listens on 127.0.0.1.
               TRAINJOBS_ALLOW_PRIVATE_TARGETS="true")  # fmt: skip
    # Testing aid (trainer_core/oom_fault.py): a micro-batch above OOM_ABOVE "runs out of memory", so a
    # job asking for more gets a real out-of-memory retry; the other tests' jobs stay at or below it.
    env[FAULT_OOM_ENV] = str(OOM_ABOVE)
    log_path = home.parent / "dev.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(trainjobs_argv(["dev", "--example", "--port", str(port)]), cwd=home.parent,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    service = DevService(f"http://127.0.0.1:{port}", KEY, home, process)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{service.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "trainjobs dev did not come up"
            time.sleep(0.3)
        yield service
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the launcher stops the worker, then the API
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="package")
def browser() -> Iterator[playwright_sync.Browser]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (make test does this as root)")
    with playwright_sync.sync_playwright() as pw:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield browser
        browser.close()


@dataclass
class Watch:
    """What a page did that a test must not allow."""

    console_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    expected: list[tuple[str, int]] = field(default_factory=list)
    cut_origins: list[str] = field(default_factory=list)

    def expect_status(self, path: str, status: int) -> None:
        """A test that provokes an API error on purpose (a 422 for a bad field): Chromium logs every
        4xx answer as a console error; this one is the page's business, not a fault."""
        self.expected.append((path, status))

    def expect_network_errors(self, origin: str) -> None:
        """A test that cuts the page's connections on purpose: Chromium logs each request that fails
        (``net::ERR_...``) as a console error; the page recovering from them is what it tests."""
        self.cut_origins.append(origin)

    def on_console(self, message: playwright_sync.ConsoleMessage) -> None:
        if message.type != "error":
            return
        url = str(message.location.get("url", ""))
        for path, status in self.expected:
            if f"status of {status} " in message.text and urlsplit(url).path == path:
                return
        if "net::ERR_" in message.text and url.startswith(tuple(self.cut_origins)):
            return
        self.console_errors.append(f"{message.text} @ {message.location}")


@pytest.fixture
def watch() -> Watch:
    return Watch()


@pytest.fixture
def page(
    browser: playwright_sync.Browser, watch: Watch, request: pytest.FixtureRequest
) -> Iterator[playwright_sync.Page]:
    """A fresh context and page; after the test: no console error, no request off 127.0.0.1, and the
    key in no URL (it travels in the Authorization header only). A failed test against the dev service
    prints the end of its log (API and worker), which a CI run keeps nowhere else."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})

    def guard(route: playwright_sync.Route) -> None:
        url = route.request.url
        watch.urls.append(url)
        host = urlsplit(url).hostname
        if url.startswith(("data:", "blob:")) or host == "127.0.0.1":
            route.continue_()
        else:
            watch.outside_requests.append(url)
            route.abort()

    context.route("**/*", guard)
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.on("console", watch.on_console)
    page.on("pageerror", lambda exc: watch.console_errors.append(f"uncaught: {exc}"))
    yield page
    context.close()
    if request.node.stash.get(CALL_FAILED, False) and "dev" in request.fixturenames:
        log = request.getfixturevalue("dev").home.parent / "dev.log"
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log.name}: last {min(len(lines), 120)} of {len(lines)} lines")
        print("\n".join(line[:400] for line in lines[-120:]))
    assert watch.outside_requests == [], "requests left 127.0.0.1"
    assert watch.console_errors == [], "console errors"
    assert not [url for url in watch.urls if KEY in url], "the API key appeared in a URL"


@pytest.fixture
def shot(tmp_path: Path) -> Callable[..., Path]:
    """shot(page, "name", full_page=True): a PNG in the test's folder, copied to out/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(page: playwright_sync.Page, name: str, full_page: bool = True) -> Path:
        path = tmp_path / f"{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        shutil.copyfile(path, SCREENSHOTS / path.name)
        return path

    return take


def log_in(page: playwright_sync.Page, dev: DevService, hash_: str = "#/jobs") -> None:
    """Open the dashboard at ``hash_`` and sign in through the login box."""
    page.goto(f"{dev.url}/dashboard{hash_}")
    page.fill("input[name=key]", dev.key)
    page.click("form.login button[type=submit]")
    page.wait_for_selector("#nav:not([hidden])")


def wait_for_job(client: Client, job_id: str, done: Callable[[dict[str, object]], bool], timeout: float) -> dict:
    """Poll the API until ``done(job)``; the job as last seen (the test asserts on it)."""
    deadline = time.monotonic() + timeout
    job = client.get(job_id)
    while not done(job) and time.monotonic() < deadline:
        time.sleep(0.5)
        job = client.get(job_id)
    return job
