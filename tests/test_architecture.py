"""The module layering and the import graph: rules a reviewer would otherwise check by eye.

Every import counts, wherever it is written: at module level, inside a function (a lazy
import is still an arrow) and under ``TYPE_CHECKING``.

The layers around the table engines: ``tables`` is the engine-neutral Delta machinery and
``spark_integration`` what a client needs from Spark plus the session the Spark engine uses;
neither imports ``engines``, which holds the engines, their factory and their typed options
and sits above both. A node's configuration holds engine options without reaching the Spark
engine or PySpark.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Iterator
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
    "deltaflow.names",
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
    "deltaflow.engines": (
        "deltaflow.client",
        "deltaflow.server",
        "deltaflow.testing",
        "deltaflow.cli",
        "deltaflow.demo",
    ),
    "deltaflow.server": ("deltaflow.client", "deltaflow.cli", "deltaflow.demo"),
}
#: Modules that must never come to import a module (or package) of the other side, by any
#: chain of imports, lazy ones included: the node's configuration holds engine options, not
#: the Spark engine.
UNREACHABLE = {
    "deltaflow.server.node_config": ("deltaflow.engines.spark",),
    "deltaflow.engines.options": ("deltaflow.engines.spark", "deltaflow.engines.delta_rs"),
}
#: Modules whose import must load none of these libraries: what they import as they load
#: (module level, outside ``TYPE_CHECKING``), the packages above those, and so on.
LIGHT = {
    "deltaflow.server.node_config": ("pyspark", "delta", "deltalake"),
    "deltaflow.engines.options": ("pyspark", "delta", "deltalake"),
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _package(name: str, path: Path) -> str:
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _sources(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """The names one import statement imports, resolved to absolute names."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    yield source
    yield from (f"{source}.{alias.name}" for alias in node.names)


def imported(name: str, path: Path) -> Iterator[str]:
    """Every name the module imports, wherever the import is written, resolved to absolute
    names."""
    package = _package(name, path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from _sources(node, package)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_on_load(name: str, path: Path) -> Iterator[str]:
    """The names the module imports as it is loaded: its imports outside functions (at module
    level, in ``if``, ``try`` and class bodies) and outside ``if TYPE_CHECKING:``."""
    package = _package(name, path)

    def run(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from _sources(node, package)
        elif isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                yield from run(child)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for child in ast.iter_child_nodes(node):
                yield from run(child)

    yield from run(ast.parse(path.read_text(encoding="utf-8")))


def module_of(name: str, known: Iterable[str]) -> str | None:
    """The deltaflow module an imported name is in: the longest module it starts with."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the deltaflow modules it imports (a name resolves to its longest module)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {module_of(t, known) for t in imported(name, path) if t.startswith("deltaflow")}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str | None]:
    """Every module ``start`` comes to import by a chain of imports, each with the module
    that imports it on the shortest chain (``start``: None)."""
    via: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target not in via:
                    via[target] = module
                    following.append(target)
        frontier = following
    return via


def chain(via: dict[str, str | None], end: str) -> str:
    """The chain of imports that reaches ``end`` (see :func:`reachable`)."""
    links = [end]
    while (before := via[links[-1]]) is not None:
        links.append(before)
    return " -> ".join(reversed(links))


def loaded_with(start: str) -> set[str]:
    """What importing ``start`` loads: the deltaflow modules (each with the packages above
    it, which Python runs first) and the top-level packages of other libraries, by the
    imports each runs as it is loaded."""
    known = modules()
    loaded: set[str] = set()
    pending = with_packages(start)
    while pending:
        name = pending.pop()
        if name in loaded:
            continue
        loaded.add(name)
        if name not in known:
            continue  # another library: its top-level package
        for target in imported_on_load(name, known[name]):
            if not target.startswith("deltaflow"):
                pending.append(target.partition(".")[0])
            elif (module := module_of(target, known)) is not None:
                pending.extend(with_packages(module))
    return loaded


def with_packages(module: str) -> list[str]:
    """``module`` and the packages above it."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


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


@pytest.mark.parametrize("module", sorted(UNREACHABLE))
def test_a_module_never_comes_to_import_what_it_must_not(module: str) -> None:
    via = reachable(import_graph(), module)
    broken = sorted(
        chain(via, target)
        for target in via
        if any(within(target, banned) for banned in UNREACHABLE[module])
    )
    assert broken == [], f"{module} must not come to import these"


def test_a_lazy_import_is_an_arrow_of_the_chains() -> None:
    """The engine factory imports an engine only when it is chosen: still an arrow."""
    via = reachable(import_graph(), "deltaflow.engines")
    assert chain(via, "deltaflow.engines.spark") == "deltaflow.engines -> deltaflow.engines.spark"


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_a_light_module_loads_no_heavy_library(module: str) -> None:
    assert sorted(loaded_with(module) & set(LIGHT[module])) == []


def test_what_a_module_loads_counts_its_packages_and_not_its_lazy_imports() -> None:
    loaded = loaded_with("deltaflow.engines.options")
    assert {"deltaflow", "deltaflow.engines", "deltaflow.spark_integration.session"} <= loaded
    # The factory's engines are imported when one is built, the session's PySpark when a
    # session is made.
    assert not {"deltaflow.engines.spark", "deltaflow.engines.delta_rs", "pyspark"} & loaded
    assert "aiohttp" in loaded_with("deltaflow.server.node_config")  # its peers, by chains


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
    """Importing the node, the engines' factory and options and the packages loads no Spark,
    Arrow, delta-rs or pandas, nor an engine, and the node does not load the client."""
    code = (
        "import sys, deltaflow, deltaflow.server, deltaflow.tables, deltaflow.engines, "
        "deltaflow.engines.options, deltaflow.spark_integration, deltaflow.receivers\n"
        "heavy = {'pyspark', 'delta', 'deltalake', 'pyarrow', 'pandas', 'numpy'}\n"
        "engines = {'deltaflow.engines.spark', 'deltaflow.engines.delta_rs'}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in engines "
        "or m.startswith('deltaflow.client'))\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_every_break_finds_the_code_it_breaks() -> None:
    """``make breaks`` changes one piece of code per guarantee: a break whose code moved would
    stop saying anything (it reports itself, but only when run)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("breaks", root / "tools" / "breaks.py")
    assert spec is not None and spec.loader is not None
    breaks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breaks)
    moved = [
        name
        for name, brk in breaks.BREAKS.items()
        if (root / brk.path).read_text(encoding="utf-8").count(brk.old) != 1
    ]
    assert moved == [], "update these breaks in tools/breaks.py"
