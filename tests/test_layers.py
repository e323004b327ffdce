"""The layers of fxopt import downward only (issue 37).

``fxopt.ir`` (the graph vocabulary: op table, alias analysis, contracts, invariants) is the
bottom layer: it imports nothing of fxopt but itself and the leaves (errors). The tiler
sits on it and imports no pass and no capture. No import circle exists among fxopt's
modules, function-level imports included: the import graph is read from the source (an
AST walk), so a circle a lazy import hides is found too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Modules any layer may import: they import nothing of fxopt themselves.
LEAVES = ("fxopt.errors", "fxopt.paths", "fxopt._lazy")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "fxopt").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The fxopt module an import of ``name`` loads (a name imported from a module is that
    module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the fxopt modules it imports anywhere in its source (function bodies
    included, ``TYPE_CHECKING`` blocks too)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                names = [f"{base}.{alias.name}" for alias in node.names] or [base]
            else:
                continue
            for name in names:
                if name.startswith("fxopt"):
                    target = _resolve(name)
                    if target and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circle_among_fxopts_modules():
    assert import_circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_a_lazy_import_closes():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def _layer_of(module: str) -> str:
    for layer in ("fxopt.ir", "fxopt.tiling"):
        if module == layer or module.startswith(f"{layer}."):
            return layer
    return module


# What each bottom layer may import besides itself and the leaves (their command lines
# live in fxopt.cli).
ALLOWED = {"fxopt.ir": (), "fxopt.tiling": ("fxopt.ir",)}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_bottom_layer_imports_only_itself_the_layers_below_and_the_leaves(layer):
    graph = import_graph()
    allowed = (layer, *ALLOWED[layer], *LEAVES)
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _layer_of(module) == layer
        for target in targets
        if _layer_of(target) not in allowed
    )
    assert upward == []


BLOCKED = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    blocked = {blocked!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in blocked):
                raise ImportError(f"{{name}} is above this layer")
            return None

    sys.meta_path.insert(0, Refuse())
    import {package} as package
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
    print("imported")
    """
)


@pytest.mark.parametrize(
    "package, blocked",
    [
        (
            "fxopt.ir",
            [
                "fxopt.passes",
                "fxopt.verify",
                "fxopt.capture",
                "fxopt.tiling",
                "fxopt.cli",
                "fxopt.api",
                "fxopt.remat",
                "fxopt.circle",
                "fxopt.layout",
            ],
        ),
        (
            "fxopt.tiling",
            ["fxopt.passes", "fxopt.capture", "fxopt.verify", "fxopt.api", "fxopt.cli"],
        ),
    ],
)
def test_a_layer_imports_in_a_fresh_interpreter_with_the_layers_above_unimportable(
    package, blocked
):
    code = BLOCKED.format(blocked=blocked, package=package)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("imported")
