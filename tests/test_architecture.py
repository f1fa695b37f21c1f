"""The module layering and the import graph: rules a reviewer would otherwise check by eye.

Every import counts, wherever it is written: at module level, inside a function (a lazy
import is still an arrow) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import deltaflow

PACKAGE = Path(deltaflow.__file__).parent

#: The foundations every layer may use: the wire, the errors, the partition function, Arrow
#: pages and the fault seam.
BASE = {
    "deltaflow.errors",
    "deltaflow.partitioning",
    "deltaflow.protocol",
    "deltaflow.outbox",
    "deltaflow.columnar",
    "deltaflow._arrow_ipc",
    "deltaflow._faults",
}

#: What each layer must never import (besides the foundations, which all may).
FORBIDDEN = {
    "deltaflow.client": (
        "deltaflow.server",
        "deltaflow.receivers",
        "deltaflow.tables",
        "deltaflow.spark_integration",
        "deltaflow.engines",
        "deltaflow.testing",
        "deltaflow.cli",
        "deltaflow.demo",
    ),
    "deltaflow.receivers": (
        "deltaflow.client",
        "deltaflow.server",
        "deltaflow.tables",
        "deltaflow.spark_integration",
        "deltaflow.engines",
    ),
    "deltaflow.storage": (
        "deltaflow.client",
        "deltaflow.server",
        "deltaflow.receivers",
        "deltaflow.tables",
        "deltaflow.spark_integration",
        "deltaflow.engines",
        "deltaflow.testing",
        "deltaflow.cli",
        "deltaflow.demo",
    ),
    "deltaflow.tables": (
        "deltaflow.client",
        "deltaflow.server",
        "deltaflow.spark_integration",
        "deltaflow.engines",
        "deltaflow.testing",
        "deltaflow.cli",
        "deltaflow.demo",
    ),
    "deltaflow.spark_integration": (
        "deltaflow.server",
        "deltaflow.engines",
        "deltaflow.cli",
        "deltaflow.demo",
    ),
    "deltaflow.server": ("deltaflow.client", "deltaflow.cli", "deltaflow.demo"),
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path) -> Iterator[str]:
    """Every ``deltaflow`` name the module imports, resolved to absolute names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the deltaflow modules it imports (a name resolves to its longest module)."""
    known = modules()

    def module_of(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {module_of(t) for t in imported(name, path) if t.startswith("deltaflow")}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_none_of_the_layers_it_must_not(layer: str) -> None:
    graph = import_graph()
    broken = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if within(source, layer)
        for target in targets
        if any(within(target, banned) for banned in FORBIDDEN[layer])
    )
    assert broken == [], f"{layer} must not import these"


def test_the_foundations_import_only_each_other() -> None:
    graph = import_graph()
    broken = sorted(
        f"{source} -> {target}" for source in BASE for target in graph[source] if target not in BASE
    )
    assert broken == []


def test_no_module_is_over_about_500_lines() -> None:
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 520
    }
    assert long == {}, "split these by idea (docs/architecture.md)"


def test_heavy_libraries_and_the_client_load_only_when_used() -> None:
    """Importing the node, the engines' seam and the packages loads no Spark, Arrow, delta-rs
    or pandas, and the node does not load the client."""
    code = (
        "import sys, deltaflow, deltaflow.server, deltaflow.tables, deltaflow.engines, "
        "deltaflow.spark_integration, deltaflow.receivers\n"
        "heavy = {'pyspark', 'delta', 'deltalake', 'pyarrow', 'pandas', 'numpy'}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy "
        "or m.startswith('deltaflow.client'))\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == ""
