"""`trainer/` has no import cycle: the graph of module-level imports, read from the source with
`ast`, is acyclic.

Counted: `import` statements that run when a module is imported (at module level, also inside a
module-level `try`/`if`/`with`), absolute or relative. Not counted: imports inside functions
(run later, on demand) and under `if TYPE_CHECKING:` (never run). `from package import module`
is an edge to the module only; `from package import name` (a name its `__init__` defines), an
edge to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trainer"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _module_level(node.body)
            found += _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found += _module_level(block)
            for handler in node.handlers:
                found += _module_level(handler.body)
        elif isinstance(node, ast.With):
            found += _module_level(node.body)
    return found


def _every_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    nodes = (node for stmt in body for node in ast.walk(stmt))
    return [node for node in nodes if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph(
    root: Path = ROOT, package: str = PACKAGE, *, every: bool = False
) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports at module level (`every`: also in
    functions and under `TYPE_CHECKING`)."""
    read = _every_import if every else _module_level
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in read(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from a import b`: the module a.b when there is one, else a name of a
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets = [sub if sub in files else base for sub in subs]
            for target in targets:
                while target and target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]  # `import a.b.c` of a non-module: its module
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_graph_reader_sees_cycles(tmp_path: Path) -> None:
    """The reader on a made-up package: a real cycle (absolute one way, relative the other)
    is found; lazy and TYPE_CHECKING imports are not edges."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "a.py").write_text("from pkg.sub import c\nimport pkg.sub.c as cc\n")
    (pkg / "b.py").write_text("from pkg.sub import VALUE, c\nfrom . import a\n")
    c_py = "try:\n    from ..a import x\nexcept ImportError:\n    x = 0\n"
    (pkg / "sub" / "c.py").write_text(c_py)
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
        "def f():\n    from pkg import a\n"
    )
    (pkg / "e.py").write_text("import pkg.d\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.c"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c", "pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == set()
    assert graph["pkg.e"] == {"pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.c"]]
    every = import_graph(tmp_path, "pkg", every=True)
    assert every["pkg.d"] == {"pkg.a"}


def test_trainer_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "trainer.api.app" in graph
    assert cycles(graph) == []


def test_no_import_cycle_even_lazily() -> None:
    """The stricter reading: imports inside functions and for type checking count too (a
    session sees its resource through `trainer/engine/handle.py`, never the other way)."""
    assert cycles(import_graph(every=True)) == []
