import logging
import threading

import pytest
import torch

from p2p_diloco.config import ModelConfig, OuterConfig
from p2p_diloco.core.exclusion import Rules
from p2p_diloco.core.merging import global_norm
from p2p_diloco.core.outer import GlobalState, OuterOptimizer, weighted_mean
from p2p_diloco.learner.round import OuterRound, Stage
from p2p_diloco.sim.faults import FaultPlan
from p2p_diloco.train.models.registry import build_model
from tests.unit.fake_averaging import FakeAveraging, FakeGroup


def _learner(seed_shift: float):
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8), seed=0)
    state = GlobalState.from_module(model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.sub_(seed_shift * (i + 1) * 1e-3)
    return state, list(model.parameters())


@pytest.mark.parametrize("steps_per_outer, work, span",
                         [(None, 1.0, 1.0), (10, 1.0, 2.0), (5, 1.0, 4.0),
                          (40, (100 * 10 + 200 * 20 + 700 * 40) / 40_000, 1.0)])
def test_group_commits_identical_state_and_bumps_version(steps_per_outer, work, span):
    group = FakeGroup(3)
    learners = [_learner(s) for s in (1.0, 2.0, 3.0)]
    tokens, steps = [100, 200, 700], [10, 20, 40]
    outcomes = [None] * 3

    def go(i):
        state, params = learners[i]
        rnd = OuterRound(state, OuterOptimizer(OuterConfig()), group.member(str(i)), params, tokens[i], steps[i],
                         steps_per_outer=steps_per_outer)
        outcomes[i] = rnd.run()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    assert all(o.committed for o in outcomes)
    assert {s.sha256() for s, _ in learners} == {learners[0][0].sha256()}
    assert all(s.version == 1 for s, _ in learners)
    assert all(o.group_tokens == 1000 for o in outcomes)

    # The committed Θ equals a reference outer step on the token-weighted mean of the three Δ.
    ref_state, _ = _learner(0.0)
    deltas = [[g - p.detach() for g, p in zip(ref_state.params, params, strict=False)] for _, params in
              [_learner(s) for s in (1.0, 2.0, 3.0)]]
    # A round of fewer steps than H is that share of an outer step: the members' claimed steps over H; one of
    # more spans the lower median of the steps (20) over H.
    OuterOptimizer(OuterConfig()).apply(ref_state, weighted_mean(deltas, tokens), work=work, span=span)
    for a, b in zip(learners[0][0].params, ref_state.params, strict=False):
        torch.testing.assert_close(a, b)


def test_failed_round_commits_nothing():
    state, params = _learner(1.0)
    before = state.sha256()
    out = OuterRound(state, OuterOptimizer(OuterConfig()), FakeAveraging(FakeGroup(1), "a", fail=True),
                     params, 100, 10).run()
    assert out.stage is Stage.FAILED and not out.committed
    assert "no group" in out.reason
    assert state.sha256() == before and state.version == 0


class _StubAveraging:
    """Returns a canned result, to check what the round refuses."""

    def __init__(self, deltas, groupmates, seconds=0.0):
        self.deltas, self.groupmates, self.seconds = deltas, groupmates, seconds

    def average(self, deltas, weight, metadata, version, fragment=0, grace=None, search_seconds=None, standing=None):
        from p2p_diloco.core.averaging_api import AverageResult

        mates = {k: (dict(metadata) if v == "same" else v) for k, v in self.groupmates.items()}
        return AverageResult(self.deltas or [d.clone() for d in deltas], mates, self.seconds, 0)


def test_round_refuses_groupmate_with_other_state():
    state, params = _learner(1.0)
    other = {"version": 0, "sha256": "0" * 64, "tokens": 5, "steps": 1, "weight": 5.0, "norm": 0.0}
    out = OuterRound(state, OuterOptimizer(OuterConfig()), _StubAveraging(None, {"me": "same", "x": other}),
                     params, 100, 10).run()
    assert not out.committed and "holds version 0" in out.reason
    assert state.version == 0


def test_round_refuses_non_finite_or_huge_average():
    state, params = _learner(1.0)
    bad = [torch.full_like(p, float("nan")) for p in state.params]
    out = OuterRound(state, OuterOptimizer(OuterConfig()), _StubAveraging(bad, {"me": "same"}),
                     params, 100, 10).run()
    assert not out.committed and "not finite" in out.reason
    huge = [torch.full_like(p, 1e6) for p in state.params]
    out = OuterRound(state, OuterOptimizer(OuterConfig()), _StubAveraging(huge, {"me": "same"}),
                     params, 100, 10, max_delta_norm=10.0).run()
    assert not out.committed and "exceeds" in out.reason
    assert state.version == 0


def test_the_certificate_waits_at_least_as_long_as_the_all_reduce_took():
    class Certifier:
        lineage = "run"

        def __init__(self):
            self.asked: list[float] = []

        def certify(self, commit, sketch=None, verify=None, sketch_key="", patience=0.0):
            self.asked.append(patience)
            return "no signatures (test)"

    state, params = _learner(1.0)
    certifier = Certifier()
    out = OuterRound(state, OuterOptimizer(OuterConfig()), _StubAveraging(None, {"me": "same"}, seconds=37.5),
                     params, 100, 10, certifier=certifier).run()
    assert not out.committed and out.reason == "no signatures (test)" and certifier.asked == [37.5]


def test_round_without_progress_does_not_average():
    state, params = _learner(0.0)
    out = OuterRound(state, OuterOptimizer(OuterConfig()), _StubAveraging(None, {"me": "same"}),
                     params, 0, 0).run()
    assert not out.committed


def test_the_fake_implements_the_whole_averaging_interface():
    from p2p_diloco.core.averaging_api import Averaging

    assert isinstance(FakeAveraging(), Averaging)


def _group_round(group: FakeGroup, poison: str | None, rda: bool = False):
    """Learners 0-2 honest, learner 3 poisoned from round 1 on; returns (learners, outcomes)."""
    learners = [_learner(s) for s in (1.0, 2.0, 3.0, 4.0)]
    tokens = [100, 200, 700, 400]
    outcomes: list = [None] * 4

    def go(i):
        state, params = learners[i]
        faults = FaultPlan.parse(f"poison at round 1 with {poison}" if i == 3 and poison else None)
        outcomes[i] = OuterRound(state, OuterOptimizer(OuterConfig()), group.member(str(i)), params, tokens[i], 10,
                                 rda=rda, faults=faults).run()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    return learners, outcomes, tokens


@pytest.mark.parametrize(("poison", "why"), [("nan", "its outer gradient is not finite"),
                                             ("scale 1e6", "x the median"), ("flip", None)])
def test_a_poisoned_contribution_is_left_out_and_the_others_commit_without_it(poison, why, caplog):
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.learner.round"):
        learners, outcomes, tokens = _group_round(FakeGroup(4), poison)
    if why is None:  # a sign flip keeps its norm: nothing in the metadata tells it apart (robust aggregation would)
        assert all(o.committed for o in outcomes)
        return
    assert [o.committed for o in outcomes] == [True, True, True, False]
    assert outcomes[3].reason.startswith("excluded 3 from fragment 0 version 0: ") and why in outcomes[3].reason
    assert all(o.group_size == 3 and o.group_tokens == 1000 for o in outcomes[:3])
    honest = [s for s, _ in learners[:3]]
    assert len({s.sha256() for s in honest}) == 1 and all(s.version == 1 for s in honest)
    assert honest[0].contributors == [(1, ("0", "1", "2"))]
    assert learners[3][0].version == 0
    # The committed Θ is the outer step on the token-weighted mean of the three honest Δ only.
    ref_state, _ = _learner(0.0)
    deltas = [[g - p.detach() for g, p in zip(ref_state.params, params, strict=True)] for _, params in
              [_learner(s) for s in (1.0, 2.0, 3.0)]]
    OuterOptimizer(OuterConfig()).apply(ref_state, weighted_mean(deltas, tokens[:3]))
    assert all(torch.equal(a, b) for a, b in zip(honest[0].params, ref_state.params, strict=True))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("excluded 3")]
    assert len(lines) == 3 and all(why in line for line in lines)  # one line at each honest member


def test_clipping_bounds_each_contribution_plain_and_radial():
    cap = 1e-3
    learners, outcomes, _ = _group_round(FakeGroup(4, Rules(0.0, max_contribution_norm=cap)), "scale 1e6")
    assert all(o.committed for o in outcomes)  # the outlier rule is off: clipping alone bounds the big one
    step = [a - b for a, b in zip(_learner(0.0)[0].params, learners[0][0].params, strict=True)]
    # Outer SGD with Nesterov from zero momentum: Θ moves by lr·(1 + momentum)·Δ̄, and ‖Δ̄‖ ≤ cap.
    assert global_norm(step) <= 0.7 * 1.9 * cap * (1 + 1e-5)

    captured = []

    class Capture(OuterOptimizer):
        def apply(self, state, deltas, tokens=0, work=1.0, span=1.0):
            captured.append(global_norm(deltas))
            super().apply(state, deltas, tokens=tokens, work=work, span=span)

    group = FakeGroup(2, Rules(0.0, max_contribution_norm=cap))
    pair = [_learner(s) for s in (1.0, 2.0)]
    norms = [global_norm([g - p.detach() for g, p in zip(s.params, ps, strict=True)]) for s, ps in pair]
    assert min(norms) > cap
    threads = [threading.Thread(target=lambda i=i: OuterRound(
        pair[i][0], Capture(OuterConfig()), group.member(str(i)), pair[i][1], 100, 10, rda=True).run())
        for i in range(2)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    # RDA keeps the weighted mean of the (clipped) norms.
    assert captured and all(abs(n - cap) <= 1e-6 * cap for n in captured)
