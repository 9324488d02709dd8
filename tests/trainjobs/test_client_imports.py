"""The client and the remote commands read the status vocabulary without loading the server's stack."""

from __future__ import annotations

import subprocess
import sys

from tests.trainjobs.live import REPO


def test_client_and_remote_commands_load_no_sqlalchemy_celery_or_torch() -> None:
    code = (
        "import sys, trainjobs.client, trainjobs.follow, trainjobs.commands.remote\n"
        "print(sorted(m for m in ('sqlalchemy', 'celery', 'torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
