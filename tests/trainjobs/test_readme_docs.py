"""The README documents every setting (with its default), every CLI command and every failure reason,
and says of each reason what the code does: whether something sets it, whether the job goes back to
the queue with it, and which modules, spec fields and settings decide when."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pydantic import BaseModel

from service_core.settings import Settings
from service_core.status import ErrorReason
from tests.trainjobs.live import REPO
from trainer_core.spec import JobSpec
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
    return [reason for reason, _, _ in failure_reason_rows()]


def failure_reason_rows() -> list[tuple[str, str, str]]:
    """(reason, statuses, meaning) of each row of the README's failure-reason table."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Failure reasons", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \| (.+) \|$", section, re.M)


def _error_reason(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ErrorReason":
        return node.attr
    return None


def reasons_in_code() -> tuple[set[str], set[str]]:
    """(the reasons some code gives a job, those it puts a job back in the queue with), from the source.

    The service names them as ``ErrorReason.x``; a requeue passes ``requeue_reason=ErrorReason.x`` or
    moves the job to ``JobStatus.queued`` with ``reason=ErrorReason.x``. A run names its own reason
    as a string (``trainer_core`` cannot import the enum): whatever ``failure_reason`` returns.
    """
    given: set[str] = set()
    requeued_with: set[str] = set()
    for package in ("service_core", "api", "worker"):
        for path in (REPO / package).rglob("*.py"):
            if path == REPO / "service_core" / "status.py":  # the definition, not a use
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (reason := _error_reason(node)) is not None:
                    given.add(reason)
                if not isinstance(node, ast.Call):
                    continue
                keywords = {kw.arg: kw.value for kw in node.keywords}
                to_queue = any(ast.unparse(arg) == "JobStatus.queued" for arg in node.args)
                for name, value in keywords.items():
                    if (reason := _error_reason(value)) is not None and (
                        name == "requeue_reason" or (name == "reason" and to_queue)
                    ):
                        requeued_with.add(reason)
    failures = ast.parse((REPO / "trainer_core" / "failures.py").read_text())
    function = next(n for n in ast.walk(failures) if isinstance(n, ast.FunctionDef) and n.name == "failure_reason")
    values = {reason.value for reason in ErrorReason}
    given |= {n.value for n in ast.walk(function) if isinstance(n, ast.Constant) and n.value in values}
    return given, requeued_with


def spec_field_exists(dotted: str) -> bool:
    model: type[BaseModel] = JobSpec
    for part in dotted.split("."):
        field = model.model_fields.get(part)
        if field is None:
            return False
        inner = field.annotation
        inner = next((a for a in getattr(inner, "__args__", ()) if isinstance(a, type)), inner)
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else BaseModel
    return True


def test_the_readme_documents_every_failure_reason_once() -> None:
    rows = failure_reasons_table()
    assert len(rows) == len(set(rows)), "a reason is listed twice"
    assert set(rows) == {reason.value for reason in ErrorReason}


def test_the_failure_reason_table_says_what_the_code_does() -> None:
    given, requeued_with = reasons_in_code()
    assert requeued_with >= {"shutdown_requeue", "worker_lost", "out_of_memory"}, requeued_with  # the scan works
    aliases = {str(field.validation_alias) for field in Settings.model_fields.values()}
    for reason, statuses, meaning in failure_reason_rows():
        # "reserved" only for a reason nothing sets yet; every reason set by code is documented as such.
        assert ("reserved" in meaning) == (reason not in given), (reason, meaning)
        assert ("queued" in statuses) == (reason in requeued_with), (reason, statuses)
        for module in re.findall(r"`([\w/]+\.py)`", meaning):  # a module that decides when
            assert (REPO / module).is_file(), (reason, module)
            assert reason in (REPO / module).read_text(), f"{module} does not mention {reason}"
        for dotted in re.findall(r"`((?:training|resources|dataset|model|efficiency|optimizer)\.[\w.]+)`", meaning):
            assert spec_field_exists(dotted), (reason, dotted)
        for setting in re.findall(r"`(TRAINJOBS_[A-Z_]+)`", meaning):
            assert setting in aliases, (reason, setting)


def test_the_preference_tuning_example_is_a_valid_spec_with_the_defaults_it_states() -> None:
    import yaml

    readme = (REPO / "README.md").read_text()
    section = readme.split("### Preference tuning", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    spec = JobSpec.model_validate(yaml.safe_load(block))
    assert spec.method == "dpo" and spec.init_from is not None and spec.adapter is not None
    written = spec.preference_settings
    defaults = type(written)()
    assert (written.beta, written.loss_type, written.label_smoothing, written.reference) == (
        defaults.beta, defaults.loss_type, defaults.label_smoothing, defaults.reference
    )  # the comments call them the defaults
    assert (spec.dataset.prompt_column, spec.dataset.chosen_column, spec.dataset.rejected_column) == (
        "prompt", "chosen", "rejected"
    )
