"""The rules docs/architecture.md and STYLE.md state about the code, checked on the source.

Each rule is a checker over source text (over a package, for the submodule rule) that
returns its offenders as ``path:line: what``. Each test first runs its checker on a small
snippet that breaks the rule and asserts the break is found, so a checker gone blind
fails, then runs it over ``src/fxopt`` and lists every offender.

a. **No ATen spelling outside the vocabulary.** ``torch.ops.aten`` (in any form: an
   attribute chain, ``aten = torch.ops.aten``, ``from torch.ops import aten``,
   ``getattr(torch.ops, "aten")``) appears only in ``fxopt/ir/`` and the Circle lowering
   (``fxopt/circle/lower/`` and the decomposition table beside it). Other code matches by
   canonical name (``ops.is_call``, ``ops.info(node).name``, ``ops.aten_name``) and builds
   with ``ops.emit``. Docstring examples may build ATen graphs: they are text.
b. **Passes read arguments by name.** In ``fxopt/passes/`` no ``node.args[...]`` and no
   ``a, b = node.args``: ``fxopt.ir.ops.args(node)`` binds them by name for every spelling.
   (Handing ``node.args`` whole to a generic walk, as CSE's key and constant folding's
   evaluation do, is not reading an argument.)
c. **No graph rewrite outside a Pass.** A call that changes an fx graph
   (:data:`GRAPH_CHANGES`: adding, erasing, moving or rewiring nodes, dead code
   elimination, ``ops.emit``/``ops.set_args``; an assignment to a node's ``args``,
   ``kwargs`` or ``target``) appears only

   1. in a pass: a module of the pass packages (``fxopt/passes/``, ``fxopt/circle/passes/``:
      the passes, their rules and the rewrite helpers they call) or a module that defines
      a subclass of fxopt's ``Pass`` (remat's passes);
   2. in ``fxopt/ir/``, the vocabulary passes rewrite with (``emit``, ``set_args``,
      copying);
   3. in a module of :data:`GRAPH_BUILDERS`, each there with its reason: code that makes a
      graph no pass has seen yet. That is capture, which turns a tracer's raw output
      (torch.export's, AOTAutograd's, the joint graph AOTAutograd hands the compile
      backend) into fxopt's graph, and functions that build a new graph, or a copy they
      made themselves, and hand it back.

   A rewrite of a graph someone handed over belongs in a ``Pass`` run by the
   ``PassManager`` (timing, invariant checks, errors naming the pass). Method calls on
   ``self`` are not graph calls (``self.output(x)`` is a module's own layer).
d. **No package attribute hides a submodule.** For every package ``fxopt.X`` and
   submodule ``fxopt.X.y``, once both are imported ``fxopt.X.y`` is that module (a function
   named like its module made ``fxopt.tiling.match`` the function).
e. **Class names are unique** in ``src/fxopt``: one name, one meaning, in docs, errors and
   ``isinstance`` checks alike (:data:`ALLOWED_DUPLICATES`: the pairs left to other work,
   each to be removed when resolved).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fxopt"


def sources(root: Path = PACKAGE) -> dict[str, str]:
    """Every module under ``root``: its path relative to ``root`` (posix) → its text."""
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*.py"))}


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in prefixes)


def _offenders(found: dict[str, list[tuple[int, str]]]) -> list[str]:
    return [f"{path}:{line}: {what}" for path, hits in found.items() for line, what in hits]


# --- a. ATen spellings -----------------------------------------------------------------

#: Where ``torch.ops.aten`` may be spelled, and why.
ATEN_ALLOWED = (
    "ir/",  # the vocabulary: the op table, binding, emit
    "circle/lower/",  # the Circle lowering table, keyed by ATen overload
    # The decompositions handed to torch.export's run_decompositions, which keys them by
    # ATen overload: part of lowering to Circle, ATen by definition.
    "circle/decompose.py",
)


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""


def aten_spellings(source: str) -> list[tuple[int, str]]:
    """(line, code) of every ``torch.ops.aten`` spelling in ``source`` (code, not text)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "aten":
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "ops") or (
                isinstance(owner, ast.Attribute) and owner.attr == "ops"
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.ops.aten") or (
                node.module in ("torch.ops", "torch._ops")
                and any(alias.name == "aten" for alias in node.names)
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            if any(alias.name.startswith("torch.ops.aten") for alias in node.names):
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and _dotted(node.func) == "getattr"
            and len(node.args) >= 2
            and _dotted(node.args[0]).endswith("ops")
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "aten"
        ):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_aten_checker_finds_every_form_of_the_spelling():
    snippet = textwrap.dedent(
        '''
        """>>> torch.ops.aten.relu.default(x)   (a docstring example: text, allowed)"""
        import torch
        from torch.ops import aten as spelled
        A = torch.ops.aten.relu.default
        aten = torch.ops.aten
        B = getattr(torch.ops, "aten")
        ok = ops.aten_name(node) == "relu"
        '''
    )
    assert [line for line, _ in aten_spellings(snippet)] == [4, 5, 6, 7]


def test_no_aten_spelling_outside_ir_and_the_circle_lowering():
    found = {
        path: hits
        for path, text in sources().items()
        if not _under(path, ATEN_ALLOWED) and (hits := aten_spellings(text))
    }
    assert not found, "torch.ops.aten spelled outside fxopt.ir (use ops.is_call / ops.emit):\n" + (
        "\n".join(_offenders(found))
    )


# --- b. positional node.args in passes -----------------------------------------------------


def positional_args(source: str) -> list[tuple[int, str]]:
    """(line, code) of every ``x.args[...]`` and every unpacking of ``x.args``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "args"
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Assign, ast.For, ast.comprehension)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value if isinstance(node, ast.Assign) else node.iter
            unpacked = any(isinstance(t, (ast.Tuple, ast.List)) for t in targets)
            if unpacked and isinstance(value, ast.Attribute) and value.attr == "args":
                found.append((getattr(node, "lineno", value.lineno), ast.unparse(value)))
    return sorted(found)


def test_the_positional_args_checker_finds_indexing_and_unpacking():
    snippet = textwrap.dedent(
        """
        conv = bn.args[0]
        weight, bias = conv.args[1:3]
        x, w = conv.args
        key = tuple(norm(a) for a in node.args)  # the whole tuple, for a key: allowed
        ok = ops.args(conv)["weight"]
        """
    )
    assert [line for line, _ in positional_args(snippet)] == [2, 3, 4]


def test_passes_read_node_arguments_by_name():
    found = {
        path: hits
        for path, text in sources().items()
        if path.startswith("passes/") and (hits := positional_args(text))
    }
    assert not found, "positional node.args in a pass (read them with ops.args):\n" + (
        "\n".join(_offenders(found))
    )


# --- c. graph rewrites outside a Pass ------------------------------------------------------

#: Method calls that change an fx graph (``Node.append`` moves a node too, but shares its
#: name with ``list.append``: not checked).
GRAPH_CHANGES = frozenset(
    {
        "replace_all_uses_with",
        "replace_input_with",
        "erase_node",
        "create_node",
        "call_function",
        "call_module",
        "call_method",
        "placeholder",
        "output",
        "get_attr",
        "inserting_before",
        "inserting_after",
        "node_copy",
        "graph_copy",
        "eliminate_dead_code",
        "prepend",
        "update_arg",
        "update_kwarg",
        "insert_arg",
        "emit",
        "set_args",
    }
)
#: Node attributes whose assignment rewires the graph.
NODE_FIELDS = frozenset({"args", "kwargs", "target"})

#: Where graphs may change outside a pass: the pass packages and the vocabulary.
REWRITE_PLACES = ("passes/", "circle/passes/", "ir/")

#: Modules that build graphs no pass has seen yet, and why they may (rule c.3).
GRAPH_BUILDERS = {
    "capture.py": "capture: torch.export's module made a plain GraphModule (the guard node "
    "set aside, buffer reads through copies so autograd runs through buffer updates)",
    "circle/export.py": "capture for conversion: the exported program's graph without the "
    "buffer writes, constant inputs and runtime asserts a Circle file cannot hold",
    "remat/aot_capture.py": "capture: AOTAutograd's joint graph flattened to "
    "(*primals) -> (*outputs, *gradients)",
    "remat/capture.py": "capture: the raw joint graph (capture_joint's, or the one AOTAutograd "
    "hands the compile backend) put in forward | backward order, dead aliases dropped",
    "layout.py": "builds each layout candidate: a channels-last copy it makes itself, and a "
    "new graph that calls the original model",
    "remat/measure.py": "with_boundary_marker: an instrumented copy it makes itself",
    "remat/profile.py": "lean_schedule: a new graph (graph_copy) handed to the recompute pass",
    "circle/lower/": "lowering: a new Circle graph built from the fx graph (ctx.emit writes "
    "Circle operators; the fx graph is only read)",
}


def graph_changes(source: str) -> list[tuple[int, str]]:
    """(line, code) of every call or assignment in ``source`` that changes an fx graph."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr in GRAPH_CHANGES and not (
                isinstance(owner, ast.Name) and owner.id == "self"
            ):
                found.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (
                        isinstance(item, ast.Attribute)
                        and item.attr in NODE_FIELDS
                        and not (isinstance(item.value, ast.Name) and item.value.id == "self")
                    ):
                        found.append((node.lineno, ast.unparse(item)))
    return sorted(found)


def _base_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for base in cls.bases:
        while isinstance(base, ast.Subscript):  # Pass[Plan]
            base = base.value
        if isinstance(base, ast.Name):
            names.add(base.id)
        elif isinstance(base, ast.Attribute):
            names.add(base.attr)
    return names


def pass_classes(texts: Iterable[str]) -> set[str]:
    """Names of the classes deriving from ``Pass`` (directly or not) in ``texts``."""
    bases = {
        node.name: _base_names(node)
        for text in texts
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
    }
    found = {"Pass"}
    while True:
        more = {name for name, of in bases.items() if of & found} - found
        if not more:
            return found - {"Pass"}
        found |= more


def defines_a_pass(source: str, passes: set[str]) -> bool:
    return any(
        isinstance(node, ast.ClassDef) and (node.name in passes or _base_names(node) & passes)
        for node in ast.walk(ast.parse(source))
    )


def rewrites_outside_passes(texts: dict[str, str]) -> dict[str, list[tuple[int, str]]]:
    """path → the graph changes in it that rule c does not allow."""
    passes = pass_classes(texts.values()) | {"Pass"}
    return {
        path: hits
        for path, text in texts.items()
        if not _under(path, REWRITE_PLACES)
        and not _under(path, GRAPH_BUILDERS)
        and not defines_a_pass(text, passes)
        and (hits := graph_changes(text))
    }


def test_the_rewrite_checker_finds_a_rewrite_outside_a_pass():
    helper = textwrap.dedent(
        """
        def cleanup(gm):
            for node in list(gm.graph.nodes):
                if not node.users:
                    gm.graph.erase_node(node)
            with gm.graph.inserting_before(first):
                new = ops.emit(gm.graph, "relu", x)
            node.args = (new,)
            self.output(x)  # a module's own method: not a graph call
        """
    )
    as_pass = "from fxopt.passes.base import Pass\n\nclass Cleanup(Pass[Plan]):\n    pass\n"
    found = rewrites_outside_passes(
        {"helpers.py": helper, "cleanup.py": as_pass + helper, "passes/x.py": helper}
    )
    assert list(found) == ["helpers.py"]
    assert [line for line, _ in found["helpers.py"]] == [5, 6, 7, 8]


def test_graphs_are_rewritten_only_by_passes():
    texts = sources()
    found = rewrites_outside_passes(texts)
    assert not found, "graph rewrites outside a Pass (make them passes run by PassManager):\n" + (
        "\n".join(_offenders(found))
    )
    gone = [
        entry
        for entry in GRAPH_BUILDERS
        if not any(_under(path, [entry]) and graph_changes(text) for path, text in texts.items())
    ]
    assert not gone, f"GRAPH_BUILDERS lists modules that no longer build graphs: {gone}"


# --- d. attributes hiding submodules -------------------------------------------------------


def hidden_submodules(package: str) -> list[str]:
    """Submodules ``P.y`` of ``package`` (nested packages included) for which, with both
    imported, ``P.y`` is not the module. A submodule needing an extra that is not installed
    is left out."""
    root = importlib.import_module(package)
    names = []
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] == package.split(".")[0]:
                raise
            continue
        names.append(info.name)
    hidden = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        found = getattr(sys.modules[parent], leaf, None)
        if found is not sys.modules[name]:
            hidden.append(f"{name} is {type(found).__name__} {getattr(found, '__name__', '')}")
    return hidden


def test_the_submodule_checker_finds_a_function_named_like_its_module(tmp_path, monkeypatch):
    package = tmp_path / "hides"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("from hides.match import match\n")
    (package / "match.py").write_text("def match():\n    return 1\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "fine.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert hidden_submodules("hides") == ["hides.match is function match"]
    finally:
        for name in [n for n in sys.modules if n == "hides" or n.startswith("hides.")]:
            del sys.modules[name]


@pytest.mark.filterwarnings("ignore")  # importing every module wakes optional extras up
def test_no_package_attribute_hides_a_submodule():
    assert hidden_submodules("fxopt") == []


# --- e. unique class names -----------------------------------------------------------------

#: Class names allowed twice (none: an entry names the pair and why, and the test fails
#: when it goes stale).
ALLOWED_DUPLICATES: dict[str, set[str]] = {}


def duplicate_class_names(texts: dict[str, str]) -> dict[str, list[str]]:
    """Class name → ``path:line`` of each definition, for names defined more than once."""
    where: dict[str, list[str]] = {}
    for path, text in texts.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path}:{node.lineno}")
    return {name: found for name, found in where.items() if len(found) > 1}


def test_the_class_name_checker_finds_a_name_defined_twice():
    texts = {"a.py": "class Plan:\n    pass\n", "b.py": "x = 1\n\n\nclass Plan(Base):\n    pass\n"}
    assert duplicate_class_names(texts) == {"Plan": ["a.py:1", "b.py:4"]}


def test_class_names_are_unique():
    found = duplicate_class_names(sources())
    allowed = {
        name: where
        for name, where in found.items()
        if {entry.rpartition(":")[0] for entry in where} == ALLOWED_DUPLICATES.get(name)
    }
    clashes = {name: where for name, where in found.items() if name not in allowed}
    assert not clashes, "class names defined more than once:\n" + "\n".join(
        f"{name}: {', '.join(where)}" for name, where in clashes.items()
    )
    stale = sorted(set(ALLOWED_DUPLICATES) - set(allowed))
    assert not stale, f"ALLOWED_DUPLICATES lists names no longer duplicated: {stale}"
