"""schemathesis against the real API: every operation fuzzed (stateless) and chained (stateful)
with every check schemathesis has (status codes, content types, headers, response schemas,
positive/negative data, Allow, auth ignored or not, use after free...) plus a 10 s response-time
bound, and no failure allowed (issue 15).

The app is served by uvicorn on a PostgreSQL database (the production shape: JSONB refuses what
SQLite stores), called with a non-admin key. Submitted jobs never train: the app's enqueuer is
replaced by one that cancels the job at once, as its owner would before a worker took it, so every
job is terminal and its event and log streams end (a queued job's stream would run until it ends).

Where acceptance depends on the server's state, not on the request's shape (a data file or model
that exists, cross-field rules of a spec such as local SGD needing the accelerate backend), the
operations say so in their descriptions and schemathesis is told 422 is an expected answer there;
everywhere else the schema states exactly what is accepted.
"""

from __future__ import annotations

import copy
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck
from hypothesis import strategies as st
from schemathesis.specs.openapi.schemas import OpenApiSchema
from sqlalchemy import create_engine, text

from api.main import create_app
from api.quotas import RateLimiter
from api.schemas.examples import EXAMPLE_ESTIMATE_REQUEST, EXAMPLE_JOB_CREATE
from service_core.db.base import Base
from service_core.db.jobstore import transition
from service_core.keys import create_api_key
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from tests.api.live import serve
from trainjobs.launcher import write_example

pytestmark = [pytest.mark.both_databases, pytest.mark.slow, pytest.mark.postgres]

MIN_CASES = 1000
MAX_RESPONSE_S = 10
# Cases per operation in each stateless phase, and stateful scenarios: sized for ~1,000+ requests
# in about two minutes on two cores. Derandomized: CI replays the same cases every run.
STATELESS_EXAMPLES = 10
STATEFUL_SCENARIOS = 30
# Acceptance here depends on files, models and datasets on the server and on cross-field rules (a
# usage period's `to` after its `from`), which no JSON schema can state: a well-formed request may be
# refused with a 422 naming the field.
STATE_DEPENDENT = [
    ("POST", "/v1/jobs"), ("POST", "/v1/estimates"), ("POST", "/v1/estimates/memory"), ("GET", "/v1/usage")
]
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]  # the default, plus 422
# A multipart body carries text only: the "boolean" or "object" a negative case puts in a form part
# arrives as the text `false` or `{}`, a valid name and a valid file, so type violations there cannot
# be refused. The upload's real limits (name length and NUL, file names) are pinned in test_datasets.
MULTIPART = [("POST", "/v1/datasets")]
# A query parameter the route does not declare is ignored, as on every GET (FastAPI's rule): a negative
# case that only adds one to the log page, reached from a job the state machine made, gets its 200.
IGNORED_QUERY = [("GET", "/v1/jobs/{job_id}/logs")]
NEGATIVE_REFUSED = ["400", "401", "403", "404", "405", "406", "409", "415", "422", "428", "429", "5xx"]

CASES: dict[str, int] = {"stateless": 0, "stateful": 0}


def cancel_at_once(app: FastAPI) -> Any:
    """An enqueuer that cancels the job instead of handing it to a worker: nothing trains."""

    def enqueue(job_id: str, _queue: str, _priority: int, _settings: Settings) -> None:
        with app.state.sessionmaker() as session:
            transition(
                session, job_id, JobStatus.cancelled, reason=ErrorReason.cancelled,
                message="cancelled by the fuzz test", expect=JobStatus.queued,
            )  # fmt: skip
            session.commit()

    return enqueue


def api_document() -> dict[str, Any]:
    """The app's OpenAPI document (building it touches no database: the engine never connects)."""
    with tempfile.TemporaryDirectory() as home:
        settings = Settings.model_validate(
            {"TRAINJOBS_HOME": home, "DATABASE_URL": f"sqlite:///{home}/unused.db", "ARTIFACTS_ROOT": home}
        )
        return create_app(settings).openapi()


def load_schema() -> OpenApiSchema:
    overrides = [
        {
            "include-method": method,
            "include-path": path,
            "checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}},
        }
        for method, path in STATE_DEPENDENT
    ] + [
        {
            "include-method": method,
            "include-path": path,
            "checks": {"negative_data_rejection": {"expected-statuses": [*NEGATIVE_REFUSED, "201"]}},
        }
        for method, path in MULTIPART
    ] + [
        {
            "include-method": method,
            "include-path": path,
            "checks": {"negative_data_rejection": {"expected-statuses": [*NEGATIVE_REFUSED, "200"]}},
        }
        for method, path in IGNORED_QUERY
    ]
    config = schemathesis.Config.from_dict(
        {
            "seed": 15,
            "checks": {"enabled": True, "max_response_time": MAX_RESPONSE_S},
            "generation": {"max-examples": STATELESS_EXAMPLES},
            "operations": overrides,
        }
    )
    return schemathesis.openapi.from_dict(api_document(), config=config)


# Loaded when the module is collected, so each operation is a test of its own (schemathesis's
# fixture-based lazy loading does not run on pytest 9.2).
schema = load_schema()

# Paths the file system refuses to look up (a part longer than it allows, a path longer than PATH_MAX,
# a loop of links, a file where a folder should be), put into the path fields of generated specs: each
# must be a 422 naming the field, never a 500 (issue 31). Relative, so they land under the fuzzed app's
# data root, where `served` makes `loop` and `file.csv`.
REFUSED_PATHS = ["a" * 300, "d/" + "b" * 256, "c/" * 2100, "loop/x", "file.csv/x", "org/" + "e" * 200]
PATH_FIELDS = [("model", "name_or_path"), ("model", "tokenizer"), ("model", "processor"),
               ("dataset", "path"), ("dataset", "data_dir"), ("dataset", "data_files")]  # fmt: skip


def with_refused_path(body: Any, where: tuple[str, str], path: str) -> Any:
    """``body`` (a job, or an estimate request's ``spec``) with one path field set to ``path``."""
    changed = copy.deepcopy(body)
    spec = changed.get("spec", changed) if isinstance(changed, dict) else None
    if isinstance(spec, dict) and isinstance(spec.get(where[0]), dict):
        spec[where[0]][where[1]] = path
    return changed


@schema.hook("flatmap_body")
def refused_paths(context: schemathesis.HookContext, body: Any) -> Any:
    """Half the generated bodies as they are, half with a refused path in one of their path fields."""
    return st.one_of(st.just(body), st.builds(with_refused_path, st.just(body), st.sampled_from(PATH_FIELDS),
                                              st.sampled_from(REFUSED_PATHS)))  # fmt: skip


@dataclass
class Served:
    """The fuzzed app, served on a fresh PostgreSQL database, and how to call it."""

    app: FastAPI
    database_url: str
    call: dict[str, Any]

    def start_afresh(self) -> None:
        """Back to the state the fuzzing starts from: no rows but the keys, no submits counted."""
        empty_tables(self.database_url, keep=("api_keys",))
        self.app.state.rate_limiter = RateLimiter(self.app.state.rate_limiter.per_minute)


def empty_tables(database_url: str, keep: tuple[str, ...] = ()) -> None:
    engine = create_engine(database_url)
    with engine.begin() as conn:
        names = [t.name for t in Base.metadata.sorted_tables if t.name not in keep]
        conn.execute(text(f"TRUNCATE {', '.join(names)} CASCADE"))
    engine.dispose()


@pytest.fixture(scope="module")
def served(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    empty_tables(pg_url)
    home: Path = tmp_path_factory.mktemp("fuzz")
    settings = Settings.model_validate(
        {
            "TRAINJOBS_HOME": home,
            "DATABASE_URL": pg_url,
            "BROKER_URL": f"sqla+sqlite:///{home / 'broker.db'}",
            "ARTIFACTS_ROOT": str(home / "artifacts"),
            "DATA_ROOT": home / "data",
            "TRAINJOBS_SECRET_KEY": "test-secret-" + secrets.token_hex(8),
            "TRAINJOBS_MAX_UPLOAD_MB": 1,
        }
    )
    write_example(settings)  # what the schema's submit example names: it is accepted as it stands
    (settings.data_root / "loop").symlink_to("loop")  # for REFUSED_PATHS
    (settings.data_root / "file.csv").write_text("text,label\n")
    app = create_app(settings)
    app.state.enqueue = cancel_at_once(app)
    with app.state.sessionmaker() as session:
        key = create_api_key(session, "alice", settings=settings)
        session.commit()
    with serve(app) as url:
        # The first estimate waits for the warm-up imports (torch, transformers): not a request's time.
        assert app.state.warmed_up.wait(600), "the API did not warm up"
        # So does each model's first estimate (built once on the meta device) and first preflight
        # (its tokenizer loaded once): the examples' models are ready before the clock runs.
        auth = {"Authorization": f"Bearer {key}"}
        for path, body in [
            ("/v1/estimates/memory", EXAMPLE_ESTIMATE_REQUEST),
            ("/v1/jobs?dry_run=true", EXAMPLE_JOB_CREATE),
        ]:
            assert httpx.post(f"{url}{path}", json=body, headers=auth, timeout=300).status_code == 200
        yield Served(app, pg_url, {"base_url": url, "headers": auth, "timeout": 3 * MAX_RESPONSE_S})


@pytest.fixture
def fuzz_target(served: Served) -> dict[str, Any]:
    """How to call the app: its URL, alice's key, and a client timeout longer than the check's bound,
    so a slow answer fails the check by name."""
    return served.call


FUZZ_SETTINGS = hypothesis.settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@FUZZ_SETTINGS
def test_every_operation_holds_every_check(case: schemathesis.Case, fuzz_target: dict[str, Any]) -> None:
    CASES["stateless"] += 1
    case.call_and_validate(**fuzz_target)


def test_chained_operations_hold_every_check(served: Served) -> None:
    # From the state the fuzzing starts from, not from what the tests above left: the chains follow
    # the answers (ids, lists, quotas), and hypothesis stops a run whose draws differ between its
    # replays of one case (FlakyStrategyDefinition: seen on the Authorization header, after the
    # stateless tests, when this file ran on its own).
    served.start_afresh()
    fuzz_target = served.call
    base = schema.as_state_machine()

    class Counted(base):  # type: ignore[valid-type, misc]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return fuzz_target

        def after_call(self, response: Any, case: schemathesis.Case) -> None:
            CASES["stateful"] += 1

    Counted.run(
        settings=hypothesis.settings(
            FUZZ_SETTINGS, max_examples=STATEFUL_SCENARIOS, stateful_step_count=6, phases=list(hypothesis.Phase)
        )
    )
    assert CASES["stateful"] > 0


def test_fuzzed_enough_cases() -> None:
    """Runs last in this module: the two tests above sent at least MIN_CASES generated requests."""
    print(f"schemathesis cases: {CASES}")
    assert CASES["stateless"] > 0 and CASES["stateful"] > 0, CASES
    assert sum(CASES.values()) >= MIN_CASES, CASES
