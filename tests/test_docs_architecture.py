"""docs/architecture.md stays true: every path it names exists, every ``file.py:name`` is defined in
that file, and every ``name()`` in its diagrams is defined in one of the files it names. Its Words
table names each thing once, and the names that once said several things stay retired."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
# `path`, `path/`, `path.py:name` or `path.py:Class.method` inside backticks
PATH_MENTION = re.compile(r"^(?P<path>[\w.-]+(?:/[\w.-]*)*)(?::(?P<name>[A-Za-z_][\w.]*))?$")
CALL_MENTION = re.compile(r"\b([A-Za-z_]\w*)\(\)")


def defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments, and ``Class.member`` for what a class defines."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}.{member.name}")
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def mentions(text: str) -> list[tuple[str, str | None]]:
    """``(path, name or None)`` for each backticked path outside the fenced blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        match = PATH_MENTION.match(span)
        if match and ("/" in match["path"] or match["path"].endswith((".py", ".md", ".toml"))):
            found.append((match["path"], match["name"]))
    return found


def test_the_doc_names_paths_and_functions() -> None:
    found = mentions(DOC.read_text(encoding="utf-8"))
    assert ("service_core/db/jobstore.py", "insert_job") in found
    assert ("trainer_core/memory/", None) in found and len(found) > 40


def test_every_path_and_name_the_doc_mentions_exists() -> None:
    missing = []
    for path, name in mentions(DOC.read_text(encoding="utf-8")):
        target = REPO / path
        if not target.exists():
            missing.append(f"{path} (no such path)")
        elif name is not None and name not in defined_names(target):
            missing.append(f"{path}:{name} (not defined there)")
    assert not missing, "docs/architecture.md names what does not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_call_in_the_diagrams_is_defined_in_a_file_the_doc_names() -> None:
    text = DOC.read_text(encoding="utf-8")
    files = {REPO / path for path, _ in mentions(text) if path.endswith(".py") and (REPO / path).is_file()}
    known = set().union(*(defined_names(f) for f in files))
    known |= {name.rpartition(".")[2] for name in known}  # RunWatch.check_stop is written check_stop()
    unknown = sorted(set(CALL_MENTION.findall(text)) - known)
    assert not unknown, f"docs/architecture.md calls what no file it names defines: {unknown}"


# Names that said one thing of several (issue 24), and what each thing is called now: the engine's entry
# is train_job and the Celery task handle_job_message (its wire name stays "trainjobs.run_job"), the
# attempt's layer execute_attempt, the run watcher's loop start_and_watch, the machine's name host_name,
# a torchrun process a rank, the API processes' parent serve_api_processes.
RETIRED = {"run_job", "run_claimed", "RunJobMessage", "RunWatch.run", "RunWatch.heartbeat", "worker_name",
           "is_distributed_worker", "supervise"}  # fmt: skip
SOURCES = ("trainer_core", "service_core", "api", "worker", "trainjobs", "tests", "bench")


def test_the_words_table_names_each_thing() -> None:
    section = DOC.read_text(encoding="utf-8").split("## Words", 1)[1].split("\n## ", 1)[0]
    words = re.findall(r"^\| ([\w ]+) \| ", section, re.M)
    assert len(words) == len(set(words)), "a word is defined twice"
    assert {"job", "attempt", "worker", "slot", "run", "supervisor", "rank", "API process", "host"} <= set(words)


def test_retired_names_are_defined_nowhere() -> None:
    paths = [path for package in SOURCES for path in sorted((REPO / package).rglob("*.py"))]
    found = [f"{path.relative_to(REPO)}: {name}" for path in paths for name in sorted(defined_names(path) & RETIRED)]
    assert not found, "a retired name is back:\n" + "\n".join(found)
    assert not (REPO / "trainer_core" / "oom_retry.py").exists()  # now memory/planner.py and oom_fault.py
