"""The package's shape, as docs/architecture.md draws it and reviews rely on it.

The layers (a lower one never imports a higher one):

* ``engine/``: the pure rules. Imports nothing of elockd outside ``engine/``, never trio.
* ``protocol/``: the sans-IO request layer. Imports ``engine/``, itself and the backend
  interface (``backend/interface.py``) only, never trio.
* ``backend/``: never ``net/``, ``daemon/`` or ``ctl/``; the cluster never the request
  layer; ``backend/cluster/etcd/`` nothing of elockd outside itself but ``observe/``
  (how every I/O layer logs).
* ``daemon/``: the process. Nothing but ``elockd/__main__.py`` imports it (``ctl/`` in
  particular does not).
* ``client/``: imports nothing of the server.

Every import counts for these rules: at module level, under ``if TYPE_CHECKING`` and
inside functions. Beside them: no runtime import cycle, no type-only import circle
(imports under ``TYPE_CHECKING`` count too), no module over 800 lines, and every
subpackage in the wheel.

Each rule is a function over an import graph, so the same rule runs over the real
package and, in ``test_each_rule_fails_on_a_graph_that_breaks_it``, over a copy of it
with one import added that breaks it: every rule can fail, and says which import.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "elockd"
MAX_LINES = 800


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is and how it runs."""

    target: str  # a dotted module name: "trio", "elockd.engine.locks"
    line: int
    typing_only: bool  # under ``if TYPE_CHECKING``
    deferred: bool  # inside a function: runs when called, not at import time


#: module name -> (its file relative to the repository, its imports)
Graph = dict[str, tuple[str, list[Import]]]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> list[Import]:
    """Every import in ``path`` (``from elockd.protocol import terse`` imports
    ``elockd.protocol.terse``; ``from trio import lowlevel``, ``trio.lowlevel``)."""
    found: list[Import] = []

    def visit(node: ast.AST, typing_only: bool, deferred: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True, deferred)
            for child in node.orelse:
                visit(child, typing_only, deferred)
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            deferred = True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module.startswith("elockd") and all(is_module(n) for n in submodules):
                targets = submodules  # a package's modules, not its __init__
            else:
                targets = [node.module]
            found.extend(Import(t, node.lineno, typing_only, deferred) for t in targets)
        elif isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, typing_only, deferred) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only, deferred)

    visit(ast.parse(path.read_text()), False, False)
    return found


def package_graph() -> Graph:
    return {
        module_name(path): (str(path.relative_to(PACKAGE.parent)), imports_of(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def within(name: str, *prefixes: str) -> bool:
    """``name`` is one of ``prefixes`` or a module inside one of them."""
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def breaches(
    graph: Graph, importer: Callable[[str], bool], allowed: Callable[[str], bool]
) -> list[str]:
    """``file:line imports X`` for each import by a module ``importer`` picks of a
    module that ``allowed`` refuses."""
    return [
        f"{path}:{imp.line} imports {imp.target}"
        for name, (path, imports) in graph.items()
        if importer(name)
        for imp in imports
        if not allowed(imp.target)
    ]


def is_trio(target: str) -> bool:
    return within(target, "trio")


def is_elockd(target: str) -> bool:
    return within(target, "elockd")


# ------------------------------------------------------------------ the rules


def engine_breaches(graph: Graph) -> list[str]:
    """engine/ imports nothing of elockd outside engine/, and never trio."""
    return breaches(
        graph,
        lambda name: within(name, "elockd.engine"),
        lambda target: not is_trio(target)
        and (not is_elockd(target) or within(target, "elockd.engine")),
    )


def protocol_breaches(graph: Graph) -> list[str]:
    """protocol/ imports engine/, protocol/ and the backend interface only; never trio."""
    return breaches(
        graph,
        lambda name: within(name, "elockd.protocol"),
        lambda target: not is_trio(target)
        and (
            not is_elockd(target)
            or target in ("elockd", "elockd.backend", "elockd.backend.interface")
            or within(target, "elockd.engine", "elockd.protocol")
        ),
    )


def backend_breaches(graph: Graph) -> list[str]:
    """backend/ never imports net/, daemon/ or ctl/."""
    return breaches(
        graph,
        lambda name: within(name, "elockd.backend"),
        lambda target: not within(target, "elockd.net", "elockd.daemon", "elockd.ctl"),
    )


def cluster_protocol_breaches(graph: Graph) -> list[str]:
    """The cluster never imports the request layer (it answers verbs, not bytes)."""
    request_layer = ("elockd.protocol.connection", "elockd.protocol.commands")
    request_layer += ("elockd.protocol.terse", "elockd.protocol.word")
    return breaches(
        graph,
        lambda name: within(name, "elockd.backend.cluster"),
        lambda target: not within(target, *request_layer),
    )


def etcd_breaches(graph: Graph) -> list[str]:
    """backend/cluster/etcd/ imports nothing of elockd outside itself (the rank rule
    of fencing tokens is passed in) but observe/, which every I/O layer logs
    through (its throttle bounds the lines a failing member causes)."""
    etcd = "elockd.backend.cluster.etcd"
    return breaches(
        graph,
        lambda name: within(name, etcd),
        lambda target: not is_elockd(target)
        or within(target, etcd, "elockd.observe")
        # the packages on its own path (their __init__ only says what they hold)
        or target in ("elockd", "elockd.backend", "elockd.backend.cluster"),
    )


def daemon_breaches(graph: Graph) -> list[str]:
    """Nothing but elockd/__main__.py (and daemon/ itself) imports daemon/."""
    return breaches(
        graph,
        lambda name: name != "elockd.__main__" and not within(name, "elockd.daemon"),
        lambda target: not within(target, "elockd.daemon"),
    )


def ctl_breaches(graph: Graph) -> list[str]:
    """ctl/ (elockctl) imports nothing of daemon/."""
    return breaches(
        graph,
        lambda name: within(name, "elockd.ctl"),
        lambda target: not within(target, "elockd.daemon"),
    )


def client_breaches(graph: Graph) -> list[str]:
    """client/ imports nothing of the server: of elockd, only client/ itself."""
    return breaches(
        graph,
        lambda name: within(name, "elockd.client"),
        lambda target: not is_elockd(target)
        or target == "elockd"
        or within(target, "elockd.client"),
    )


def loops(graph: Graph, counts: Callable[[Import], bool]) -> list[list[tuple[str, Import]]]:
    """Each import circle among elockd modules over the imports ``counts`` keeps: the
    modules in turn, each with the import that leads on to the next."""
    edges = {
        name: sorted(
            (imp for imp in imports if imp.target in graph and imp.target != name and counts(imp)),
            key=lambda imp: (imp.target, imp.line),
        )
        for name, (_, imports) in graph.items()
    }
    state: dict[str, int] = {}
    found: list[list[tuple[str, Import]]] = []

    def visit(name: str, trail: list[tuple[str, Import]]) -> None:
        state[name] = 1
        for imp in edges[name]:
            here = [*trail, (name, imp)]
            if state.get(imp.target) == 1:
                start = next(i for i, (n, _) in enumerate(here) if n == imp.target)
                found.append(here[start:])
            elif imp.target not in state:
                visit(imp.target, here)
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [])
    return found


def circles(graph: Graph, counts: Callable[[Import], bool]) -> list[str]:
    """The circles of :func:`loops` as ``a (file:line imports b) -> b (...) -> a``."""
    return [
        " -> ".join(
            f"{name} ({graph[name][0]}:{imp.line} imports {imp.target})" for name, imp in loop
        )
        for loop in loops(graph, counts)
    ]


def runtime_circles(graph: Graph) -> list[str]:
    """Cycles of imports that run when a module is imported (no TYPE_CHECKING, no
    import inside a function)."""
    return circles(graph, lambda imp: not imp.typing_only and not imp.deferred)


def type_circles(graph: Graph) -> list[str]:
    """Circles of module-level imports, those under TYPE_CHECKING included: two
    modules that name each other's types are one module, or need a third."""
    return circles(graph, lambda imp: not imp.deferred)


RULES: dict[str, Callable[[Graph], list[str]]] = {
    "engine": engine_breaches,
    "protocol": protocol_breaches,
    "backend": backend_breaches,
    "cluster_protocol": cluster_protocol_breaches,
    "etcd": etcd_breaches,
    "daemon": daemon_breaches,
    "ctl": ctl_breaches,
    "client": client_breaches,
    "runtime_circles": runtime_circles,
    "type_circles": type_circles,
}


# ------------------------------------------------------------ over the package


def obeys(found: list[str]) -> None:
    """Fail naming every offending import, one a line."""
    assert not found, "\n" + "\n".join(found)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return package_graph()


def test_engine_imports_nothing_above_it_and_no_trio(graph: Graph) -> None:
    obeys(engine_breaches(graph))


def test_protocol_imports_engine_and_the_backend_interface_only_and_no_trio(
    graph: Graph,
) -> None:
    obeys(protocol_breaches(graph))


def test_backend_imports_no_net_daemon_or_ctl(graph: Graph) -> None:
    obeys(backend_breaches(graph))


def test_the_cluster_does_not_import_the_protocol_layer(graph: Graph) -> None:
    obeys(cluster_protocol_breaches(graph))


def test_the_etcd_package_imports_nothing_of_elockd_outside_itself(graph: Graph) -> None:
    obeys(etcd_breaches(graph))


def test_nothing_but_main_imports_the_daemon(graph: Graph) -> None:
    obeys(daemon_breaches(graph))


def test_ctl_imports_nothing_of_the_daemon(graph: Graph) -> None:
    obeys(ctl_breaches(graph))


def test_the_client_imports_nothing_of_the_server(graph: Graph) -> None:
    obeys(client_breaches(graph))


def test_no_runtime_import_cycle(graph: Graph) -> None:
    obeys(runtime_circles(graph))


def test_no_type_only_import_circle(graph: Graph) -> None:
    obeys(type_circles(graph))


def test_no_module_over_800_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in PACKAGE.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


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


# --------------------------------------------------- each rule can fail

#: For each rule: a module, and an import that breaks the rule if that module had it.
#: ``typing_only``/``deferred`` as the import would be written.
VIOLATIONS: dict[str, tuple[str, Import]] = {
    "engine": ("elockd.engine.locks", Import("trio", 1, False, False)),
    "protocol": ("elockd.protocol.terse", Import("elockd.handover.pause", 1, True, False)),
    "backend": ("elockd.backend.memory", Import("elockd.net.serving", 1, False, True)),
    "cluster_protocol": (
        "elockd.backend.cluster.space",
        Import("elockd.protocol.commands", 1, False, False),
    ),
    "etcd": (
        "elockd.backend.cluster.etcd.batch",
        Import("elockd.backend.cluster.ledger", 1, False, False),
    ),
    "daemon": ("elockd.net.http", Import("elockd.daemon.startup", 1, True, False)),
    "ctl": ("elockd.ctl.upgrade", Import("elockd.daemon.startup", 1, False, False)),
    "client": ("elockd.client.blocking", Import("elockd.engine.locks", 1, False, False)),
    # engine/locks.py imports engine/sessions.py (at module level): the way back closes it.
    "runtime_circles": ("elockd.engine.sessions", Import("elockd.engine.locks", 1, False, False)),
    "type_circles": ("elockd.engine.sessions", Import("elockd.engine.locks", 1, True, False)),
}


def without_breaches(graph: Graph) -> Graph:
    """The graph with every import that breaks a rule today left out, so that the
    one added below is the only one (the package may be mid-way to its rules)."""
    clean: Graph = {}
    for name, (path, imports) in graph.items():
        kept = []
        for imp in imports:
            alone: Graph = {n: (p, []) for n, (p, _) in graph.items()}
            alone[name] = (path, [imp])
            if not any(rule(alone) for rule in RULES.values()):
                kept.append(imp)
        clean[name] = (path, kept)
    while found := loops(clean, lambda imp: not imp.deferred):
        name, closing = found[0][-1]
        path, imports = clean[name]
        clean[name] = (path, [imp for imp in imports if imp != closing])
    return clean


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_fails_on_a_graph_that_breaks_it(graph: Graph, rule: str) -> None:
    """The package's graph with one breaching import added: the rule reports it,
    naming the module's file and the import."""
    base = without_breaches(graph)
    importer, breach = VIOLATIONS[rule]
    assert importer in base, f"{importer} is gone: pick another module for {rule}"
    path, imports = base[importer]
    if rule.endswith("circles"):  # a circle needs the way there as well as back
        back = breach.target
        assert any(
            imp.target == importer and not imp.deferred for imp in base[back][1]
        ), f"{back} no longer imports {importer}: pick another pair for {rule}"
    assert RULES[rule](base) == []
    broken = {**base, importer: (path, [*imports, breach])}
    found = RULES[rule](broken)
    assert found, f"{rule} missed {importer} importing {breach.target}"
    assert all(breach.target in message for message in found), found
    assert any(f"{path}:{breach.line} imports {breach.target}" in message for message in found)


def test_the_runtime_rule_leaves_type_only_and_deferred_imports_alone(graph: Graph) -> None:
    base = without_breaches(graph)
    for typing_only, deferred in ((True, False), (False, True)):
        back = Import("elockd.engine.locks", 1, typing_only, deferred)
        path, imports = base["elockd.engine.sessions"]
        broken = {**base, "elockd.engine.sessions": (path, [*imports, back])}
        assert runtime_circles(broken) == []
        assert (type_circles(broken) != []) is typing_only
