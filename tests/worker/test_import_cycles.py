"""The worker's modules import each other one way: no circle, not even through an import inside a
function (execute.py and recovery.py used to close one that way)."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "worker"


def worker_imports() -> dict[str, set[str]]:
    """``{module: worker modules it imports}``, counting imports anywhere in the file."""
    names = {p.stem for p in WORKER.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((WORKER / f"{name}.py").read_text(encoding="utf-8"))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m.removeprefix("worker.") for m in found if m.startswith("worker.")} & names
    return graph


def test_no_worker_module_reaches_itself() -> None:
    graph = worker_imports()
    assert graph["execute"] and graph["recovery"]  # the walk sees the imports at all
    for start in graph:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            module = todo.pop()
            assert module != start, f"worker.{start} imports itself (via {sorted(seen)})"
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
