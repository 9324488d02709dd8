"""The folders' arrows, checked on the source: imports point one way and never run in a circle.

    trainer_core  <-  service_core  <-  api, worker  <-  trainjobs

Every import counts, the ones inside functions too (a lazy import is still a dependency). The graph
has one node per module; ``from pkg import name`` is an edge to ``pkg`` and, when ``pkg.name`` is a
module, to it as well (so a package ``__init__`` that re-exports is seen through).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer_core", "service_core", "api", "worker", "trainjobs")
# package -> the project packages it must not import
FORBIDDEN: dict[str, set[str]] = {
    "trainer_core": {"service_core", "api", "worker", "trainjobs"},
    "service_core": {"api", "worker", "trainjobs"},
    "api": {"worker", "trainjobs"},
    "worker": {"api", "trainjobs"},
    "trainjobs": set(),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imported_names(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` for each import in the file; ``from a import b`` gives ``a`` and ``a.b``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb from this module's package
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, [*base_parts, node.module or ""]))
            else:
                base = node.module or ""
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, name in imported_names(path, module):
            if name in modules and name != module:
                edges.setdefault(name, line)
    return graph


def wrong_way_arrows(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, edges in sorted(graph.items()):
        top = module.split(".")[0]
        for target, line in sorted(edges.items()):
            if target.split(".")[0] in FORBIDDEN[top]:
                found.append(f"{module} (line {line}) imports {target}")
    return found


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop (sorted names)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a closed path, first module repeated at the end) per circle."""
    return [shortest_cycle(graph, component) for component in circles(graph)]


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """The shortest closed path through the component's first module, for a readable report."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return [*paths[node], start]
                if target in members and target not in paths:
                    paths[target] = [*paths[node], target]
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def test_the_walker_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "service_core.status" in graph["trainjobs.client"]  # top-level `from x import y`
    assert "trainer_core.spec" in graph["trainer_core"]  # a package __init__ re-export
    assert "trainer_core.memory" in graph["api.routes.estimates"]  # an import inside a function
    assert "worker.recovery" in graph["trainjobs.launcher"]


def test_the_checks_catch_a_wrong_arrow_and_a_cycle() -> None:
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    graph = {"trainer_core.spec": {"service_core.status": 3}, "api.main": {"worker.tasks": 9}}
    assert wrong_way_arrows(graph) == [
        "api.main (line 9) imports worker.tasks",
        "trainer_core.spec (line 3) imports service_core.status",
    ]


def test_imports_point_one_way() -> None:
    assert wrong_way_arrows(import_graph()) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = [f"{' -> '.join(shortest_cycle(graph, c))}  (the circle: {', '.join(c)})" for c in circles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_status_vocabulary_is_imported_from_its_one_home() -> None:
    """JobStatus & co. live in service_core/status.py; importing them through another module (the db
    models re-exported them once) would make that module a second place to look them up."""
    import service_core.status

    vocabulary = {name for name in vars(service_core.status) if not name.startswith("_") and name.isidentifier()}
    vocabulary -= {"annotations", "enum"}
    strays = []
    for path in sorted(REPO.glob("**/*.py")):
        if ".venv" in path.parts or path.name == "status.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith(PACKAGES) and module != "service_core.status":
                assert isinstance(node, ast.ImportFrom)
                strays += [f"{path.relative_to(REPO)}:{node.lineno} {alias.name} from {module}"
                           for alias in node.names if alias.name in vocabulary]  # fmt: skip
    assert strays == []
