"""How long the dashboard's job page takes to draw its charts for a job with 100,000 metric points.

    .venv/bin/python bench/bench_dashboard.py [--steps 100000] [--runs 5]

Starts ``trainjobs serve`` on a temporary home (SQLite), submits one job to a queue no worker reads,
stores ``--steps`` logged steps for it the way the worker does (loss, learning_rate and grad_norm at
every step, so 3 x steps rows, with a loss spike; an eval point every 1,000 steps) and marks it
succeeded. Then headless Chromium (``/usr/bin/chromium``) signs in to ``/dashboard`` and opens the job
page ``--runs`` times; each run measures from the navigation (a hash change: the page is already
loaded, as when a user clicks a job) to the ``tj-charts-drawn`` performance mark the page sets once
every chart has drawn its data. It prints each run, the median and the goal (< 1 s, issue 11), the
time the thinned metrics request took, the points the charts drew, whether the spike is on the loss
chart, and the page weight (JS and CSS the dashboard loads). Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright
from sqlalchemy import create_engine, update

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service_core.db.models import Job, MetricPoint  # noqa: E402
from trainjobs.launcher import apply_migrations  # noqa: E402
from worker.procfs import all_processes  # noqa: E402

KEY = "tj_bench-dashboard-key"
GOAL_S = 1.0
SPIKE_STEP = 61_803
STATIC = REPO / "api" / "static"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_api(home: Path, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT"))}
    env.update(TRAINJOBS_HOME=str(home), TRAINJOBS_API_KEY=KEY, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    argv = [sys.executable, "-m", "trainjobs.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    log = (home / "api.log").open("ab")
    api = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).json().get("warmed_up"):
                return api
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.3)
    raise SystemExit("the API did not come up: " + (home / "api.log").read_text()[-2000:])


def seed(url: str, database_url: str, steps: int) -> str:
    """One job (never run: its queue has no worker) with `steps` logged steps and evals, succeeded."""
    spec = {
        "name": "bench-100k", "task": "text-classification",
        "model": {"config": {"model_type": "bert", "vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "intermediate_size": 37}},
        "dataset": {"path": "csv", "data_files": {"train": "bench/train.csv"}},
        "training": {"max_steps": steps, "logging_steps": 1}, "queue": "bench-nobody-reads-this",
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{url}/v1/jobs", json=spec, headers=headers, timeout=60)
    response.raise_for_status()
    job_id: str = response.json()["id"]
    engine = create_engine(database_url)
    with engine.begin() as conn:
        rows = []
        for step in range(1, steps + 1):
            loss = 25.0 if step == SPIKE_STEP else 2.0 * math.exp(-step / 20_000) + 0.05 * math.sin(step / 7)
            for name, value in (("loss", loss), ("learning_rate", 1e-4 * (1 - step / steps)), ("grad_norm", 1 + loss)):
                rows.append({"job_id": job_id, "seq": step, "step": step, "name": name, "value": value})
            if step % 1000 == 0:
                rows.append(
                    {
                        "job_id": job_id,
                        "seq": step,
                        "step": step,
                        "name": "eval_accuracy",
                        "value": 0.5 + step / steps / 2,
                    }
                )
            if len(rows) >= 50_000:
                conn.execute(MetricPoint.__table__.insert(), rows)
                rows = []
        if rows:
            conn.execute(MetricPoint.__table__.insert(), rows)
        conn.execute(update(Job).where(Job.id == job_id).values(
            status="succeeded", progress_step=steps, progress_total=steps, last_seq=steps,
            started_at=Job.created_at, finished_at=Job.created_at,
        ))  # fmt: skip
    engine.dispose()
    return job_id


def page_weight_kb() -> tuple[float, float]:
    """KB of JavaScript and of CSS the dashboard page loads (its modules, uPlot, the stylesheets)."""
    js = (
        sum(p.stat().st_size for p in (STATIC / "js").glob("*.js"))
        + (STATIC / "vendor/uplot/uPlot.iife.min.js").stat().st_size
    )
    css = (STATIC / "app.css").stat().st_size + (STATIC / "vendor/uplot/uPlot.min.css").stat().st_size
    return js / 1024, css / 1024


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the processes of group ``pgid`` (the API's)."""
    return sum(p.cpu_ticks for p in all_processes() if p.pgid == pgid) / os.sysconf("SC_CLK_TCK")


def measure(url: str, job_id: str, runs: int, api_pgid: int) -> None:
    with sync_playwright() as pw:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/dashboard#/jobs")
        page.fill("input[name=key]", KEY)
        page.click("form.login button[type=submit]")
        page.wait_for_selector("table.jobs")
        times, fetches, cpu = [], [], []
        for _ in range(runs):
            # From the compare page with nothing picked (one light request), not the list: the list
            # would fetch this job's loss sparkline at the same time and compete with the page.
            page.evaluate("location.hash = '#/compare'")
            page.wait_for_selector("select[name=add]")
            time.sleep(0.5)  # let that page's request finish before counting the API's CPU time
            cpu_before = group_cpu_seconds(api_pgid)
            elapsed = page.evaluate(
                """async (id) => {
                    performance.clearMarks(); performance.clearResourceTimings();
                    const t0 = performance.now();
                    location.hash = '#/jobs/' + id;
                    const drawnYet = () => performance.getEntriesByName('tj-charts-drawn').length;
                    while (!drawnYet()) await new Promise(r => setTimeout(r, 5));
                    const drawn = performance.getEntriesByName('tj-charts-drawn')[0].startTime;
                    const fetch = performance.getEntriesByType('resource').find(e => e.name.includes('max_points'));
                    return [drawn - t0, fetch ? fetch.duration : null];
                }""",
                job_id,
            )
            cpu.append(group_cpu_seconds(api_pgid) - cpu_before)
            times.append(elapsed[0] / 1000)
            fetches.append((elapsed[1] or 0) / 1000)
        points = page.eval_on_selector_all("[data-chart]", "els => els.map(e => [e.dataset.chart, +e.dataset.points])")
        browser.close()
    js_kb, css_kb = page_weight_kb()
    median = statistics.median(times)
    print("runs (s):", " ".join(f"{t:.3f}" for t in times))
    print(
        f"median time to charts drawn: {median:.3f} s (goal < {GOAL_S:.1f} s): {'PASS' if median < GOAL_S else 'MISS'}"
    )
    print(f"of which the thinned metrics request: median {statistics.median(fetches):.3f} s")
    print(f"API CPU time per page view (independent of other load): median {statistics.median(cpu):.3f} s")
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("points drawn per chart:", ", ".join(f"{name} {n}" for name, n in points))
    print(f"page weight: {js_kb:.1f} KB JS, {css_kb:.1f} KB CSS (uncompressed, uPlot included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        home = Path(tmp)
        database_url = f"sqlite:///{home / 'trainjobs.db'}"
        apply_migrations(database_url)
        (home / "data" / "bench").mkdir(parents=True)
        (home / "data" / "bench" / "train.csv").write_text("text,label\na,0\nb,1\n")
        port = free_port()
        api = start_api(home, port)
        try:
            url = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            job_id = seed(url, database_url, args.steps)
            print(f"seeded {args.steps} steps x 3 metrics (+ evals) in {time.monotonic() - started:.1f} s")
            measure(url, job_id, args.runs, api.pid)
        finally:
            os.killpg(api.pid, signal.SIGTERM)
            api.wait(timeout=30)


if __name__ == "__main__":
    main()
