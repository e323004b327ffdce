import operator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from torch import fx

from fxopt.errors import InvariantError, PassError, UnknownPassError, UserInputError
from fxopt.passes import Pass, PassManager, PassResult, Plan, available, resolve
from tests.passes_helpers import random_graphs


class ReplaceAddWithSub(Pass[Plan]):
    name = "add-to-sub"
    description = "deliberately wrong"

    def analyze(self, gm):
        return Plan()

    def transform(self, gm, plan):
        changed = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (torch.add, operator.add):
                node.target = torch.sub
                changed = True
        return PassResult(changed)


class Explodes(Pass[Plan]):
    name = "explodes"
    description = "raises halfway through"

    def analyze(self, gm):
        return Plan()

    def transform(self, gm, plan):
        first = next(n for n in gm.graph.nodes if n.op == "call_function")
        first.target = torch.neg  # half-rewritten when it raises
        raise RuntimeError(f"boom at {first.name}")


class BreaksGraph(Pass[Plan]):
    name = "breaks-graph"
    description = "leaves a use before its definition"

    def analyze(self, gm):
        return Plan()

    def transform(self, gm, plan):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        nodes[0].append(nodes[-1])  # move the last compute node before its input
        return PassResult(True)


@dataclass(frozen=True)
class CountPlan(Plan):
    count: int = 0


class CountingPass(Pass[CountPlan]):
    """Changes the graph twice (one relu → neg per round), then reports no change."""

    name = "counting"
    description = "test pass"

    def analyze(self, gm):
        return CountPlan(count=sum(n.target is torch.relu for n in gm.graph.nodes))

    def transform(self, gm, plan):
        for node in gm.graph.nodes:
            if node.target is torch.relu:
                node.target = torch.neg
                return PassResult(True, {"rewritten": 1})
        return PassResult(False, {"rewritten": 0})


def _graph():
    return fx.symbolic_trace(lambda x: torch.relu(torch.relu(x) + 1))


def test_fixed_point_is_bounded_and_records_rounds():
    result = PassManager([CountingPass()], max_rounds=5).run(_graph())
    assert [r.changed for r in result.records] == [True, True, False]
    assert result.rounds == 3
    capped = PassManager([CountingPass()], max_rounds=1).run(_graph())
    assert capped.rounds == 1 and len(capped.records) == 1


def test_manager_works_on_a_copy():
    gm = _graph()
    code = gm.code
    PassManager([CountingPass()], max_rounds=3).run(gm)
    assert gm.code == code


def test_failing_pass_raises_pass_error_naming_it_and_leaves_input_alone():
    gm = _graph()
    code = gm.code
    with pytest.raises(PassError) as info:
        PassManager(["cse", Explodes()]).run(gm)
    error = info.value
    assert error.pass_name == "explodes"
    assert error.passes_before == ["cse"]
    assert "relu" in error.nodes  # the node quoted by the failing pass
    assert "explodes" in str(error) and "boom" in str(error)
    assert gm.code == code


def test_broken_graph_is_caught_by_lint():
    with pytest.raises(PassError, match="breaks-graph"):
        PassManager([BreaksGraph()]).run(_graph())


def test_required_invariant_is_checked_before_the_pass():
    class NeedsFunctional(CountingPass):
        name = "needs-functional"
        requires = ("functional",)

    gm = fx.symbolic_trace(lambda x: x.add_(1))
    with pytest.raises(PassError) as info:
        PassManager([NeedsFunctional()]).run(gm)
    assert isinstance(info.value.__cause__, InvariantError)
    assert "functional" in str(info.value)


def test_registry_names_aliases_and_unknown_names():
    assert resolve("redundant_ops").name == "cse"
    assert resolve("dead_code").name == "dce"
    instance = CountingPass()
    assert resolve(instance) is instance
    with pytest.raises(UnknownPassError) as info:
        resolve("no-such-pass")
    for name in available():
        assert name in str(info.value)
    with pytest.raises(UserInputError, match="max_rounds"):
        PassManager([], max_rounds=0)


def test_pass_timings_are_recorded():
    result = PassManager(["cse", "dce"]).run(_graph())
    assert [r.name for r in result.records] == ["cse", "dce"]
    assert all(r.time_ms >= 0 for r in result.records)
    assert result.records[0].to_dict()["stats"] == {"merged": 0}


class RelusToNegs(CountingPass):
    """Rewrites every relu at once, so a second run finds nothing: idempotent."""

    name = "relus-to-negs"
    idempotent = True

    def transform(self, gm, plan):
        for node in gm.graph.nodes:
            if node.target is torch.relu:
                node.target = torch.neg
        return PassResult(plan.count > 0, {"rewritten": plan.count})

    def verify(self, gm):
        assert self.analyze(gm).count == 0


class NeverChanges(CountingPass):
    name = "never-changes"

    def transform(self, gm, plan):
        return PassResult(False)


def test_a_pass_is_not_rerun_on_the_graph_it_left():
    # Round 0: relus-to-negs changes the graph, never-changes does not. Round 1: the graph
    # is as relus-to-negs left it (idempotent: skipped) and as never-changes saw it
    # (skipped): nothing runs, the fixed point is reached.
    result = PassManager([RelusToNegs(), NeverChanges()], max_rounds=4).run(_graph())
    assert [(r.name, r.round, r.changed) for r in result.records] == [
        ("relus-to-negs", 0, True),
        ("never-changes", 0, False),
    ]
    # A pass that ran before the change runs again after it.
    result = PassManager([NeverChanges(), RelusToNegs()], max_rounds=4).run(_graph())
    assert [(r.name, r.round) for r in result.records] == [
        ("never-changes", 0),
        ("relus-to-negs", 0),
        ("never-changes", 1),
    ]
    assert result.rounds == 2


def test_the_speed_preset_reaches_the_same_graph_with_skipping():
    # Skipping only drops runs that would find nothing: the result equals a run where
    # every pass is a fresh, non-idempotent instance of itself.
    from fxopt.passes import pipelines

    def model(x):
        y = torch.relu(x) * 1
        return torch.relu(x) + y.view(-1).view(x.shape) + 0

    plain = [
        type(f"Plain{i}", (resolve(p).__class__,), {"idempotent": False, "not_enabled_by": ()})()
        for i, p in enumerate(pipelines.get("speed").pass_names())
    ]
    skipping = PassManager(pipelines.get("speed").pass_names(), max_rounds=4).run(
        fx.symbolic_trace(model)
    )
    rerun = PassManager(plain, max_rounds=4).run(fx.symbolic_trace(model))
    assert skipping.module.code == rerun.module.code
    assert len(skipping.records) < len(rerun.records)


class NotEnabledByRelusToNegs(NeverChanges):
    name = "not-enabled-by-relus-to-negs"
    not_enabled_by = ("relus-to-negs",)


def test_a_pass_stays_settled_across_a_change_it_declares_harmless():
    result = PassManager([NotEnabledByRelusToNegs(), RelusToNegs()], max_rounds=4).run(_graph())
    assert [(r.name, r.round) for r in result.records] == [
        ("not-enabled-by-relus-to-negs", 0),
        ("relus-to-negs", 0),
    ]
    # Only while the declared pass made the change alone: after another change it reruns.
    result = PassManager(
        [NotEnabledByRelusToNegs(), CountingPass(), RelusToNegs()], max_rounds=4
    ).run(_graph())
    assert ("not-enabled-by-relus-to-negs", 1) in [(r.name, r.round) for r in result.records]


_CLAIMS = [(name, enabler) for name in available() for enabler in resolve(name).not_enabled_by]


_CLAIM_IDS = [f"{settled}-after-{changer}" for settled, changer in _CLAIMS]


@pytest.mark.parametrize(("settled", "changer"), _CLAIMS, ids=_CLAIM_IDS)
@settings(max_examples=120, deadline=None)
@given(gm=random_graphs(buffers=True))
def test_declared_harmless_changes_give_no_new_work(settled, changer, gm):
    # The claims behind `not_enabled_by`, on random graphs with duplicates, dead values,
    # constants, views and in-place writes: a settled pass finds nothing after the change.
    assert _CLAIMS, "no pass declares not_enabled_by"
    resolve(settled)(gm)  # settles it (every built-in pass is idempotent)
    if resolve(changer)(gm).changed:
        assert not resolve(settled)(gm).changed, f"{changer} gave {settled} new work"


class SeedStyleReluToNeg(Pass):
    """Written to the seed's contract: analyze returns a dict, transform returns the module
    it changed in place. fxopt's contract wants a PassResult, and says so."""

    name = "seed-style"

    def analyze(self, gm):
        found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.relu]
        return {"opportunities": found, "safe": True}

    def transform(self, gm, plan):
        for node in plan["opportunities"]:
            node.target = torch.neg
        return gm


def test_a_transform_returning_the_module_fails_naming_the_pass_and_the_contract():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    with pytest.raises(TypeError, match=r"seed-style\.transform returned its graph;"):
        SeedStyleReluToNeg()(gm)
    with pytest.raises(PassError, match=r"pass 'seed-style' failed.*returns a PassResult"):
        PassManager([SeedStyleReluToNeg()]).run(fx.symbolic_trace(lambda x: torch.relu(x)))


def test_a_transform_returning_something_else_says_what_the_contract_wants():
    class ReturnsList(SeedStyleReluToNeg):
        def transform(self, gm, plan):
            return [1, 2]

    with pytest.raises(PassError, match="returns a PassResult"):
        PassManager([ReturnsList()]).run(fx.symbolic_trace(lambda x: torch.relu(x)))


def test_a_verify_returning_a_value_fails_the_pass():
    class VerifiesWithBool(ReplaceAddWithSub):
        def verify(self, gm):
            return True  # the seed's contract: a bool; fxopt's: raise, return None

    with pytest.raises(PassError, match=r"'add-to-sub'.*verify returned True"):
        PassManager([VerifiesWithBool()]).run(fx.symbolic_trace(lambda x: x + 1))


# --- one mechanism for every rewrite: nesting, boundaries, dumps, presets -------------------


def _doubled_relu():
    return fx.symbolic_trace(lambda x: torch.relu(x) + torch.relu(x))


def test_a_nested_pipeline_dumps_and_explains_through_the_outer_one():
    inner = PassManager(["cse", "dce"], name="cleanup")
    result = PassManager(["remove-nops", inner], dump_after=["cse"]).run(_doubled_relu())
    assert [r.name for r in result.records] == ["remove-nops", "cleanup"]
    assert result.records[1].stats == {"runs": 2, "changed": 1}  # cse merged, dce found none
    assert result.dumps["cse"].count("torch.relu") == 1  # the inner pass's graph, by name
    assert PassManager([inner]).pass_names() == ["cleanup", "cse", "dce"]


def test_ensures_is_checked_on_the_output_and_names_the_pipeline():
    gm = _doubled_relu()  # torch level: no fake values, so no `has-shapes`
    with pytest.raises(PassError, match=r"\(output\).*pipeline 'shaped'.*has-shapes"):
        PassManager(["cse"], ensures=["has-shapes"], name="shaped").run(gm)


def test_requires_is_checked_on_the_input_before_any_pass():
    calls = []

    class Spy(ReplaceAddWithSub):
        def analyze(self, gm):
            calls.append(1)
            return Plan()

    with pytest.raises(PassError, match=r"\(input\).*core-aten"):
        PassManager([Spy()], requires=["core-aten"]).run(_doubled_relu())
    assert calls == []


def test_unknown_invariant_names_fail_when_the_pipeline_is_built():
    with pytest.raises(KeyError, match="unknown invariant 'no-such'"):
        PassManager(["cse"], ensures=["no-such"])


def test_a_preset_is_a_fresh_pipeline_of_instances():
    from fxopt.passes import pipelines

    first = pipelines.get("speed")
    assert all(isinstance(p, Pass) for p in first.passes) and first.max_rounds == 4
    first.passes.clear()
    assert pipelines.get("speed").pass_names() == [
        "remove-nops",
        "gqa-attention",
        "fold-bn",
        "fold-constants",
        "cse",
        "dce",
    ]
    assert "circle" not in pipelines.PRESETS  # the converter owns its pipelines
