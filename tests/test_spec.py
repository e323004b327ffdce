"""The named invariants of fxopt.ir.spec, above all the well-formedness check that the
pipeline runs after every changing pass (a faster stand-in for Graph.lint)."""

import pytest
import torch
from torch import fx, nn

from fxopt.errors import InvariantError
from fxopt.ir import spec


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.block(x) * self.scale + x.relu()


def _problems(gm: fx.GraphModule) -> list[str]:
    return spec.get("well-formed").find_problems(gm)


def _lint_fails(gm: fx.GraphModule) -> bool:
    try:
        gm.graph.lint()
    except (RuntimeError, ValueError, AssertionError):
        return True
    return False


def test_a_traced_model_is_well_formed_and_agrees_with_lint():
    gm = fx.symbolic_trace(Net())
    assert _problems(gm) == []
    assert not _lint_fails(gm)
    spec.check(gm, "well-formed")


def test_use_before_definition_is_named():
    gm = fx.symbolic_trace(Net())
    compute = [n for n in gm.graph.nodes if n.op != "placeholder" and n.op != "output"]
    compute[0].prepend(compute[-1])  # the last compute node now sits before its inputs
    problems = _problems(gm)
    assert _lint_fails(gm)
    assert problems and all("before it is defined" in p for p in problems)
    assert compute[-1].name in problems[0]
    with pytest.raises(InvariantError, match="well-formed"):
        spec.check(gm, "well-formed")


def test_a_node_from_another_graph_is_named():
    gm = fx.symbolic_trace(Net())
    other = fx.symbolic_trace(Net())
    stranger = next(n for n in other.graph.nodes if n.op == "placeholder")
    relu = next(n for n in gm.graph.nodes if n.target == "relu")
    relu.args = (stranger,)
    assert _lint_fails(gm)
    assert any("another graph" in p and relu.name in p for p in _problems(gm))


@pytest.mark.parametrize(
    ("op", "target", "expected"),
    [
        ("get_attr", "block.missing", "does not exist"),
        ("call_module", "nowhere.at_all", "does not exist"),
        ("call_module", "nowhere", "does not exist"),
        ("call_module", "block", None),  # a top-level name: found in the module registry
        ("call_module", "scale", "not a submodule"),
        ("get_attr", "block.0.weight", None),
        ("call_module", "block.1", None),
    ],
)
def test_attribute_targets_are_resolved(op, target, expected):
    gm = fx.symbolic_trace(Net())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_before(out):
        gm.graph.create_node(op, target, (x,) if op == "call_module" else (), name="probe")
    problems = _problems(gm)
    assert _lint_fails(gm) == (expected is not None)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and "probe" in problems[0] and expected in problems[0]


def test_a_repeated_name_is_named():
    gm = fx.symbolic_trace(Net())
    relu = next(n for n in gm.graph.nodes if n.target == "relu")
    first = next(n for n in gm.graph.nodes if n.op == "call_module")
    relu.name = first.name  # fx keeps names unique; a careless pass may not
    problems = _problems(gm)
    assert problems == [f"the name '{first.name}' is used twice"]
    with pytest.raises(InvariantError, match="used twice"):
        spec.check(gm, "well-formed")


def test_an_unknown_opcode_is_named():
    gm = fx.symbolic_trace(Net())
    relu = next(n for n in gm.graph.nodes if n.target == "relu")
    relu.op = "call_everything"
    assert any("unknown opcode 'call_everything'" in p and relu.name in p for p in _problems(gm))


def test_problems_are_capped():
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.relu, (x,)) for _ in range(30)]
    for node in nodes:
        node.args = (nodes[-1],)  # every node reads the last one
    graph.output(nodes[0])
    problems = _problems(fx.GraphModule(nn.Module(), graph))
    assert 1 <= len(problems) <= 10


def test_unknown_invariant_lists_the_known_ones():
    with pytest.raises(KeyError, match="well-formed"):
        spec.get("no-such-invariant")
