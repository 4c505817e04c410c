import pytest
import torch

from p2p_diloco.core.outer import GlobalState
from p2p_diloco.sim.faults import LIE_VERSIONS, Fault, FaultPlan, FaultPlanError, forged_states


def test_parse_one_line_per_fault():
    plan = FaultPlan.parse("kill at round 3 during reduce; hang for 20 s at round 2 during matchmaking\n"
                           "drop for 7.5 s at round 4 during inner")
    assert plan.faults == [Fault("kill", 3, "reduce"), Fault("hang", 2, "matchmaking", 20.0),
                           Fault("drop", 4, "inner", 7.5)]
    assert not FaultPlan.parse("") and not FaultPlan.parse(None)


@pytest.mark.parametrize("bad", ["kill at round x during inner", "hang at round 2 during inner",
                                 "kill at round 2 during send in a group of 3",
                                 "kill at round 2 during lunch", "explode at round 1 during inner"])
def test_bad_plans_are_refused_with_one_line(bad):
    with pytest.raises(FaultPlanError) as e:
        FaultPlan.parse(bad)
    assert "\n" not in str(e.value)


def test_each_fault_fires_once_and_only_where_it_matches(monkeypatch):
    fired = []
    monkeypatch.setattr("p2p_diloco.sim.faults._execute", fired.append)
    plan = FaultPlan.parse("kill at round 2 during send; hang for 1 s at round 3 during serve")
    plan.fire("send", 1)
    plan.fire("reduce", 2)
    assert fired == []
    assert plan.due("send", 2) and not plan.due("send", 1)
    plan.fire("send", 2)
    plan.fire("send", 2)
    assert fired == [Fault("kill", 2, "send")]
    assert not plan.due("send", 2)
    plan.fire("serve", 5)  # a learner that skipped round 3 meets the fault at its next round
    assert fired[-1] == Fault("hang", 3, "serve", 1.0)
    plan.fire("serve", 6)
    assert len(fired) == 2


def test_poison_corrupts_the_outer_gradient_from_its_round_on(capsys):
    plan = FaultPlan.parse("poison at round 2 with scale 1e6")
    assert plan.faults == [Fault("poison", 2, "delta", mode="scale", factor=1e6)]
    delta = [torch.ones(3), torch.full((2,), -2.0)]
    assert plan.poison(delta, 1)[0] is delta[0]  # not yet
    for round_ in (2, 3, 9):  # from round 2 on, every round
        assert [t.tolist() for t in plan.poison(delta, round_)] == [[1e6] * 3, [-2e6] * 2]
    assert capsys.readouterr().err.count("fault injection: poison with scale from round 2") == 1
    assert all(torch.isnan(t).all() for t in FaultPlan.parse("poison at round 1 with nan").poison(delta, 1))
    assert FaultPlan.parse("poison at round 1 with flip").poison(delta, 4)[1].tolist() == [2.0, 2.0]
    assert not plan.due("inner", 2)  # a poison is no event: kill, hang and drop fire, poison corrupts


@pytest.mark.parametrize("bad", ["poison at round 2 with scale", "poison at round 2 with nan 3",
                                 "poison at round 2 with scale x", "poison at round 2 with salt",
                                 "poison at round two with nan", "poison at round 2 with climb 0",
                                 "poison at round 2 with climb 1.5", "poison at round 2 with diverge 2"])
def test_bad_poisons_are_refused_with_one_line(bad):
    with pytest.raises(FaultPlanError) as e:
        FaultPlan.parse(bad)
    assert "\n" not in str(e.value)


def test_climbing_negates_inner_gradients_in_its_rounds_and_leaves_the_outer_gradient_alone():
    plan = FaultPlan.parse("poison at round 3 with climb 2")
    delta = [torch.ones(2)]
    assert plan.poison(delta, 3)[0] is delta[0]  # the outer gradient is what the climbing steps made
    climbing = [r for r in range(1, 9) if plan.climbing(r)]
    assert climbing == [3, 5, 7]  # from round 3, every second round
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1.0, -2.0])
    plan.inner_gradients([p], 4)
    assert p.grad.tolist() == [1.0, -2.0]  # an honest round
    plan.inner_gradients([p], 5)
    assert p.grad.tolist() == [-1.0, 2.0]
    assert FaultPlan.parse("poison at round 1 with climb").climbing(6)  # without a period: every round


def test_diverge_makes_one_inner_step_nan():
    plan = FaultPlan.parse("poison at round 2 with diverge")
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    plan.inner_gradients([p], 1)
    assert p.grad.tolist() == [1.0, 1.0]
    plan.inner_gradients([p], 2)
    assert torch.isnan(p.grad).all()
    p.grad = torch.ones(2)
    plan.inner_gradients([p], 3)  # once: the learner heals and trains on
    assert p.grad.tolist() == [1.0, 1.0]


def test_lies_last_from_their_round_on_and_forge_a_poisoned_state():
    plan = FaultPlan.parse("lie at round 3 with state; lie at round 5 with ahead")
    assert [(f.action, f.mode, f.round) for f in plan.faults] == [("lie", "state", 3), ("lie", "ahead", 5)]
    assert not plan.lying("state", 2) and plan.lying("state", 3) and plan.lying("state", 9)
    assert not plan.lying("ahead", 4) and plan.lying("ahead", 5)
    real = GlobalState(params=[torch.ones(3)], momentum=[torch.zeros(3)], version=4)
    real.remember()
    fake = forged_states([real])[0]
    assert fake.version == 4 + LIE_VERSIONS["state"] and torch.equal(fake.params[0], torch.full((3,), -50.0))
    assert fake.descends_from(4, real.sha256()) and real.version == 4  # lists the victim's state; real untouched
    assert FaultPlan.parse("lie at round 1 with weight").lying("weight", 1)
    rounds = FaultPlan.parse("lie at round 2 with sketch; lie at round 2 with hash; lie at round 2 with quorum")
    assert not rounds.withholds_sketch(1) and rounds.withholds_sketch(2)
    assert rounds.signed_sha("a" * 64, 1) == "a" * 64 and rounds.signed_sha("a" * 64, 2) not in ("a" * 64, "")
    assert rounds.gathered_quorum(3, 1) == 3 and rounds.gathered_quorum(3, 3) == 1_000_000
    with pytest.raises(FaultPlanError, match="lie at round R with ahead"):
        FaultPlan.parse("lie at round 3 with everything")


def test_malformations_last_until_the_next_one_and_name_their_kind():
    plan = FaultPlan.parse("malform at round 2 with nan; malform at round 4 with block-huge")
    assert [(f.action, f.mode, f.round) for f in plan.faults] == [("malform", "nan", 2), ("malform", "block-huge", 4)]
    assert [plan.malforming(r) for r in range(1, 6)] == ["", "nan", "nan", "block-huge", "block-huge"]
    assert not plan.due("send", 3)  # a malformation is carried out on the wire, not fired at a stage
    with pytest.raises(FaultPlanError, match="KIND one of nan, inf"):
        FaultPlan.parse("malform at round 3 with everything")


def test_a_fault_in_a_group_of_n_waits_for_a_round_with_that_many_members(monkeypatch):
    fired = []
    monkeypatch.setattr("p2p_diloco.sim.faults._execute", fired.append)
    plan = FaultPlan.parse("kill at round 2 during commit in a group of 3")
    assert plan.faults == [Fault("kill", 2, "commit", group=3)]
    plan.fire("commit", 2, group=2)  # a pair: the others could not commit without this learner's signature
    plan.fire("commit", 3)
    assert fired == []
    plan.fire("commit", 3, group=3)
    assert fired == [Fault("kill", 2, "commit", group=3)]
