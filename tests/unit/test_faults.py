import pytest

from p2p_diloco.faults import Fault, FaultPlan, FaultPlanError


def test_parse_one_line_per_fault():
    plan = FaultPlan.parse("kill at round 3 during reduce; hang for 20 s at round 2 during matchmaking\n"
                           "drop for 7.5 s at round 4 during inner")
    assert plan.faults == [Fault("kill", 3, "reduce"), Fault("hang", 2, "matchmaking", 20.0),
                           Fault("drop", 4, "inner", 7.5)]
    assert not FaultPlan.parse("") and not FaultPlan.parse(None)


@pytest.mark.parametrize("bad", ["kill at round x during inner", "hang at round 2 during inner",
                                 "kill at round 2 during lunch", "explode at round 1 during inner"])
def test_bad_plans_are_refused_with_one_line(bad):
    with pytest.raises(FaultPlanError) as e:
        FaultPlan.parse(bad)
    assert "\n" not in str(e.value)


def test_each_fault_fires_once_and_only_where_it_matches(monkeypatch):
    fired = []
    monkeypatch.setattr("p2p_diloco.faults._execute", fired.append)
    plan = FaultPlan.parse("kill at round 2 during send; hang for 1 s at round 3 during serve")
    plan.fire("send", 1)
    plan.fire("reduce", 2)
    assert fired == []
    assert plan.due("send", 2) and not plan.due("send", 1)
    plan.fire("send", 2)
    plan.fire("send", 2)
    assert fired == [Fault("kill", 2, "send")]
    assert not plan.due("send", 2)
    plan.fire("serve", 5)  # serving fires at any round from R on
    assert fired[-1] == Fault("hang", 3, "serve", 1.0)
