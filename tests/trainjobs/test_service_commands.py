"""``trainjobs keys create`` and ``trainjobs serve``'s refusal of unsafe production settings."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import Session

from service_core.db.session import make_engine
from service_core.keys import authenticate
from service_core.settings import Settings
from tests.trainjobs.live import REPO, trainjobs_argv


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(trainjobs_argv(args), env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINJOBS_", "DATABASE_URL", "BROKER_URL"))}
    return {**env, "TRAINJOBS_HOME": str(home), **extra}


def test_keys_create_prints_a_key_that_authenticates_as_its_owner(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], env=env, cwd=REPO, check=True,
                   capture_output=True)  # fmt: skip
    made = run(["keys", "create", "--owner", "alice"], env)
    admin = run(["keys", "create", "--owner", "ops", "--admin"], env)
    assert made.returncode == 0 and admin.returncode == 0, made.stderr + admin.stderr
    settings = Settings.model_validate({"TRAINJOBS_HOME": str(tmp_path)})
    engine = make_engine(settings.database_url)
    with Session(engine) as session:
        alice = authenticate(session, made.stdout.strip(), settings.secret_key)
        ops = authenticate(session, admin.stdout.strip(), settings.secret_key)
    engine.dispose()
    assert alice is not None and (alice.owner, alice.is_admin) == ("alice", False)
    assert ops is not None and (ops.owner, ops.is_admin) == ("ops", True)

    bad = run(["keys", "create", "--owner", "no spaces/allowed"], env)
    assert bad.returncode == 2 and bad.stderr.startswith("owner: ") and "Traceback" not in bad.stderr


def test_keys_list_revoke_and_expiry(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], env=env, cwd=REPO, check=True,
                   capture_output=True)  # fmt: skip
    keep = run(["keys", "create", "--owner", "alice", "--expires", "30d"], env).stdout.strip()
    gone = run(["keys", "create", "--owner", "bob"], env).stdout.strip()
    listed = run(["keys", "list"], env)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[1]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert set(rows) == {"alice", "bob"} and gone not in listed.stdout and keep not in listed.stdout  # prefixes only
    assert rows["alice"][2] == keep[:10]
    expires = datetime.strptime(" ".join(rows["alice"][6:8]), "%Y-%m-%d %H:%M").replace(tzinfo=UTC)
    assert abs(expires - (datetime.now(UTC) + timedelta(days=30))) < timedelta(minutes=5)

    revoked = run(["keys", "revoke", rows["bob"][0]], env)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    settings = Settings.model_validate({"TRAINJOBS_HOME": str(tmp_path)})
    engine = make_engine(settings.database_url)
    with Session(engine) as session:
        assert authenticate(session, gone, settings.secret_key) is None
        assert authenticate(session, keep, settings.secret_key) is not None
    engine.dispose()
    after = {line.split()[1]: line for line in run(["keys", "list"], env).stdout.splitlines()[1:]}
    assert after["bob"].split()[-2] == datetime.now(UTC).strftime("%Y-%m-%d")  # REVOKED: today
    assert after["alice"].split()[-1] == "-"  # never revoked

    unknown = run(["keys", "revoke", "nope"], env)
    assert unknown.returncode == 2 and unknown.stderr.startswith("key_id: no key 'nope'")
    bad = run(["keys", "create", "--owner", "carol", "--expires", "soon"], env)
    assert bad.returncode == 2 and bad.stderr.startswith("--expires: ") and "Traceback" not in bad.stderr


def test_serve_refuses_production_with_the_default_secret_or_no_key(tmp_path: Path) -> None:
    refused = run(["serve", "--port", "1"], clean_env(tmp_path, TRAINJOBS_ENV="production"))
    assert refused.returncode == 2
    assert "TRAINJOBS_SECRET_KEY is the default" in refused.stderr and "TRAINJOBS_API_KEY is unset" in refused.stderr
    assert "Traceback" not in refused.stderr
