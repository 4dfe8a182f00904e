"""The package's shape, as docs and reviews rely on it: no runtime import cycle
inside ``elockd`` (imports under ``TYPE_CHECKING`` aside), no module over 800 lines,
and the cluster never imports the protocol layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "elockd"
MAX_LINES = 800


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def runtime_imports(path: Path) -> set[str]:
    """``elockd`` modules imported at module level, outside ``if TYPE_CHECKING``
    (``from elockd.protocol import terse`` imports ``elockd.protocol.terse``)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue  # imports inside are not run at import time (classes aside: none)
        for child in ast.walk(node):
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module.startswith("elockd"):
                    submodules = [f"{child.module}.{a.name}" for a in child.names]
                    if all(is_module(name) for name in submodules):
                        found.update(submodules)  # a package's modules, not its __init__
                    else:
                        found.add(child.module)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("elockd"))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: runtime_imports(path) & modules.keys() for name, path in modules.items()}


def test_no_runtime_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycles.append([*trail[trail.index(target) :], target])
            elif target not in state:
                visit(target, [*trail, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_module_over_800_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in PACKAGE.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_cluster_does_not_import_the_protocol_layer() -> None:
    protocol_layer = {
        "elockd.protocol.connection",
        "elockd.protocol.commands",
        "elockd.protocol.terse",
        "elockd.protocol.word",
    }
    for name, imports in graph().items():
        if name.startswith("elockd.backend.cluster"):
            assert not imports & protocol_layer, name


def test_every_subpackage_is_in_the_wheel() -> None:
    """pyproject.toml lists packages by hand: one left out installs without it."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for init in PACKAGE.rglob("__init__.py")
    }
    assert found <= listed, f"missing from pyproject.toml: {sorted(found - listed)}"
