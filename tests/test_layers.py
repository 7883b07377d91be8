"""The packages of `trainer/` form layers: a package imports only those listed for it, lazy and
`TYPE_CHECKING` imports included. The table is the architecture; the packages' `__init__`
docstrings say the same in words. No module reaches into another's private members."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_imports import ROOT, import_graph

# package -> the packages it may import (itself always); "top" is a module directly in trainer/
ALLOWED: dict[str, set[str]] = {
    "contract": set(),
    "compute": {"contract"},
    "checkpoint": {"contract", "compute"},
    "engine": {"contract", "compute", "checkpoint"},
    "distributed": {"contract", "compute", "checkpoint", "engine"},
    "serving": {"contract", "compute", "checkpoint", "engine"},
    "rl": {"contract", "compute", "checkpoint", "engine", "top:tiny"},
    "api": {"contract", "checkpoint", "serving"},
    "api.rl": {"contract", "checkpoint", "serving", "api"},
    "api.tinker": {"contract", "checkpoint", "serving", "api"},
    # the Fireworks control plane binds the Tinker face to its jobs (never the reverse)
    "api.fireworks": {"contract", "checkpoint", "serving", "api", "api.tinker"},
    # the app mounts the faces; `server` is the process around it
    "api.app": {
        "contract",
        "checkpoint",
        "serving",
        "api",
        "api.rl",
        "api.tinker",
        "api.fireworks",
    },
    "top:tiny": set(),
    "top:tiny_families": set(),
    "top:spawn": set(),
}
ENTRY_POINTS = {"top:cli", "top:demo", "top:__main__", "top:__init__"}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "top:__init__"
    if len(parts) == 2 and parts[1] not in ALLOWED and parts[1] != "api":
        return f"top:{parts[1]}"
    if parts[1] == "api" and (len(parts) == 2 or parts[2] in ("app", "server")):
        return "api.app"
    if parts[1] == "api" and parts[2] in ("rl", "tinker", "fireworks"):
        return f"api.{parts[2]}"
    return parts[1]


def offending_edges() -> list[str]:
    bad = []
    for module, targets in sorted(import_graph(every=True).items()):
        source = layer(module)
        if source in ENTRY_POINTS:
            continue
        assert source in ALLOWED, f"{module}: a package the layer table does not know"
        for target in sorted(targets):
            to = layer(target)
            if to != source and to not in ALLOWED[source]:
                bad.append(f"{module} -> {target}")
    return bad


def test_the_layer_table_is_kept() -> None:
    assert offending_edges() == []


def test_the_layer_reader_sees_a_violation() -> None:
    assert layer("trainer.compute.batch") == "compute"
    assert layer("trainer.api.tinker.bridge") == "api.tinker"
    assert layer("trainer.api.http") == "api"
    assert layer("trainer.api.app") == layer("trainer.api") == "api.app"
    assert layer("trainer.cli") == "top:cli"
    assert "engine" not in ALLOWED["compute"] and "api.rl" not in ALLOWED["api.tinker"]


def private_reaches(root: Path = ROOT / "trainer") -> list[str]:
    """`from trainer.x import _name`, and `module._name` on a module of `trainer` imported as
    `module`: one module using another's private member."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainer"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.name}:{node.lineno} imports {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name.startswith("trainer")}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and ast.unparse(node.value) in modules
            ):
                found.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_s_privates() -> None:
    assert private_reaches() == []


def test_the_private_reader_sees_a_reach(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from trainer.compute import batch\nfrom trainer.x import _y\nbatch._build()\n"
    )
    assert private_reaches(tmp_path) == ["a.py:2 imports _y", "a.py:3 uses batch._build"]
