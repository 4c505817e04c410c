import threading

import torch

from p2p_diloco.config import ModelConfig, OuterConfig
from p2p_diloco.models import build_model
from p2p_diloco.outer import GlobalState, OuterOptimizer, weighted_mean
from p2p_diloco.round import OuterRound, Stage

from .fake_averaging import FakeAveraging, FakeGroup


def _learner(seed_shift: float):
    model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8), seed=0)
    state = GlobalState.from_module(model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.sub_(seed_shift * (i + 1) * 1e-3)
    return state, list(model.parameters())


def test_group_commits_identical_state_and_bumps_version():
    group = FakeGroup(3)
    learners = [_learner(s) for s in (1.0, 2.0, 3.0)]
    tokens = [100, 200, 700]
    outcomes = [None] * 3

    def go(i):
        state, params = learners[i]
        rnd = OuterRound(state, OuterOptimizer(OuterConfig()), group.member(str(i)), params, tokens[i], 10)
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
    OuterOptimizer(OuterConfig()).apply(ref_state, weighted_mean(deltas, tokens))
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

    def __init__(self, deltas, groupmates):
        self.deltas, self.groupmates = deltas, groupmates

    def average(self, deltas, weight, metadata, version, fragment=0, grace=None):
        from p2p_diloco.averaging import AverageResult

        mates = {k: (dict(metadata) if v == "same" else v) for k, v in self.groupmates.items()}
        return AverageResult(self.deltas or [d.clone() for d in deltas], mates, 0.0, 0)


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


def test_round_without_progress_does_not_average():
    state, params = _learner(0.0)
    out = OuterRound(state, OuterOptimizer(OuterConfig()), _StubAveraging(None, {"me": "same"}),
                     params, 0, 0).run()
    assert not out.committed


def test_the_fake_implements_the_whole_averaging_interface():
    from p2p_diloco.averaging import Averaging

    assert isinstance(FakeAveraging(), Averaging)
