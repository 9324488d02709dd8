"""The README documents every setting (with its default), every CLI command and every failure reason."""

from __future__ import annotations

import re
from pathlib import Path

from service_core.settings import Settings
from service_core.status import ErrorReason
from tests.trainjobs.live import REPO
from trainjobs.cli import COMMANDS


def settings_table() -> dict[str, str]:
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", readme, re.M)
    return {name: default.strip() for name, default in rows}


def test_every_setting_is_in_the_table_with_its_default() -> None:
    table = settings_table()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        assert isinstance(alias, str), name
        assert alias in table, f"{alias} is not documented in the README's Settings table"
        default = field.get_default(call_default_factory=True)
        if isinstance(default, int | float | str | Path):
            if isinstance(default, bool):  # as it is written in the environment
                shown = str(default).lower()
            else:
                shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert f"`{shown}`" in table[alias], (alias, default, table[alias])
    assert set(table) == {f.validation_alias for f in Settings.model_fields.values()}


def test_every_command_is_in_the_cli_reference() -> None:
    readme = (REPO / "README.md").read_text()
    for command in COMMANDS:
        assert f"| `trainjobs {command}" in readme, command


def failure_reasons_table() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Failure reasons", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, re.M)


def test_the_readme_documents_every_failure_reason_once() -> None:
    rows = failure_reasons_table()
    assert len(rows) == len(set(rows)), "a reason is listed twice"
    assert set(rows) == {reason.value for reason in ErrorReason}
