"""The import graph, read from the source with `ast`: no circles, and every arrow points down.

Layers, lowest first: the contract (the generated stubs, splitspec/contract.py and the shared
argument types in splitspec/cli_args.py), common/,
the two services, then the tools (the `splitspec` client and launcher, bench/, scripts/),
then tests/. A module imports only from its own layer or lower ones; the services do not
import each other; the client package stands alone on the contract (no common, no
services); and nothing imports a test module (shared test helpers live in tests/procs.py,
tests/tiny_models.py and the like). Every import counts, also one inside a function or
under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT

ROOTS = ("common", "target_service", "draft_service", "splitspec", "bench", "scripts", "tests")
CONTRACT = ("splitspec.v1", "splitspec.contract", "splitspec.cli_args")
SERVICES = ("target_service", "draft_service")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _top(module: str) -> str:
    return module.split(".")[0]


def layer(module: str) -> int:
    if _within(module, CONTRACT):
        return 0
    if _within(module, ("common",)):
        return 1
    if _within(module, SERVICES):
        return 2
    if _within(module, ("tests",)):
        return 4
    return 3  # splitspec (client and launcher), bench, scripts


def project_modules(root: Path = REPO_ROOT) -> dict[str, Path]:
    modules = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement of the module may refer to."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module → the project modules it imports (a name resolves to its longest module prefix)."""
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def wrong_way_arrows(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer(target) > layer(source):
                problems.append(f"{source} -> {target}: imports from a higher layer")
            elif _within(source, SERVICES) and _within(target, SERVICES) and _top(source) != _top(target):
                problems.append(f"{source} -> {target}: one service imports the other")
            elif _within(source, ("splitspec",)) and not _within(target, ("splitspec",)):
                problems.append(f"{source} -> {target}: the client package stands on the contract alone")
            elif target.split(".")[-1].startswith("test_"):
                helpers = "tests/procs.py, tests/tiny_models.py or another helper module"
                problems.append(f"{source} -> {target}: imports a test module (move the helper to {helpers})")
    return problems


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The repository's import graph, read once for the checks below."""
    return import_graph(project_modules())


def test_the_import_graph_has_no_circles(graph):
    assert len(graph) > 80  # the whole tree was read
    assert circles(graph) == []


def test_every_import_points_down_a_layer(graph):
    assert wrong_way_arrows(graph) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A tree with one circle and each kind of wrong-way arrow, each one found."""
    files = {
        "common/__init__.py": "",
        "common/a.py": "from common import b\n",
        "common/b.py": "def f():\n    from common.a import x\n",  # a lazy import still closes the circle
        "common/c.py": "if TYPE_CHECKING:\n    from target_service.engine import E\n",  # type-only: counts
        "target_service/__init__.py": "",
        "target_service/engine.py": "from draft_service import host\nfrom . import helper\n",
        "target_service/helper.py": "",
        "draft_service/__init__.py": "",
        "draft_service/host.py": "",
        "splitspec/__init__.py": "",
        "splitspec/up.py": "from common.c import TOKEN\n",
        "bench/__init__.py": "",
        "bench/run.py": "from tests.tiny import make\n",
        "tests/__init__.py": "",
        "tests/tiny.py": "",
        "tests/test_x.py": "from tests.test_y import helper\n",
        "tests/test_y.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(project_modules(tmp_path))
    assert {"draft_service.host", "target_service.helper"} <= graph["target_service.engine"]  # relative, too
    assert circles(graph) == [["common.a", "common.b"]]
    assert [p.split(":")[0] for p in wrong_way_arrows(graph)] == [
        "bench.run -> tests.tiny",
        "common.c -> target_service.engine",
        "splitspec.up -> common.c",
        "target_service.engine -> draft_service",
        "target_service.engine -> draft_service.host",
        "tests.test_x -> tests.test_y",
    ]
