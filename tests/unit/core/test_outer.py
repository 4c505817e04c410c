import copy

import pytest
import torch

from p2p_diloco.config import ModelConfig, OuterConfig
from p2p_diloco.core.outer import (
    MAX_SPAN,
    GlobalState,
    OuterOptimizer,
    decayed_momentum,
    pseudo_gradient,
    rebase,
    round_span,
    round_work,
    weighted_mean,
)
from p2p_diloco.train.models.registry import build_model


def _tensors(seed, shapes=((3, 4), (5,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def test_weighted_mean_matches_plain_reference():
    deltas = [_tensors(i) for i in range(3)]
    weights = [1.0, 2.0, 5.0]
    out = weighted_mean(deltas, weights)
    for k in range(2):
        ref = sum(w * d[k].double() for d, w in zip(deltas, weights, strict=False)) / sum(weights)
        torch.testing.assert_close(out[k].double(), ref, rtol=1e-6, atol=1e-6)


def test_weighted_mean_rejects_bad_weights():
    with pytest.raises(ValueError):
        weighted_mean([_tensors(0)], [0.0])
    with pytest.raises(ValueError):
        weighted_mean([], [])


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov):
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    params = _tensors(1)
    state = GlobalState(params=[p.clone() for p in params], momentum=[torch.zeros_like(p) for p in params])
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=nesterov)
    opt = OuterOptimizer(cfg)
    for step in range(5):
        grads = _tensors(100 + step)
        opt.apply(state, grads, tokens=10)
        for r, g in zip(ref, grads, strict=False):
            r.grad = g.clone()
        sgd.step()
        for mine, theirs in zip(state.params, ref, strict=False):
            torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-6)
    assert state.version == 5
    assert state.tokens == 50
    assert state.momentum_initialized


def test_plain_reference_nesterov_formula():
    """Θ ← Θ − lr(Δ + μb), b ← μb + Δ, written out by hand for two steps."""
    lr, mu = 0.5, 0.8
    theta, d1, d2 = torch.tensor([1.0]), torch.tensor([0.2]), torch.tensor([-0.1])
    state = GlobalState(params=[theta.clone()], momentum=[torch.zeros(1)])
    opt = OuterOptimizer(OuterConfig(lr=lr, momentum=mu))
    opt.apply(state, [d1])
    b = d1
    expected = theta - lr * (d1 + mu * b)
    opt.apply(state, [d2])
    b = mu * b + d2
    expected = expected - lr * (d2 + mu * b)
    torch.testing.assert_close(state.params[0], expected)


def test_identical_inputs_give_identical_hash():
    model = build_model(ModelConfig(), seed=3)
    a, b = GlobalState.from_module(model), GlobalState.from_module(model)
    assert a.sha256() == b.sha256()
    grads = [torch.full_like(p, 0.01) for p in a.params]
    OuterOptimizer(OuterConfig()).apply(a, grads)
    OuterOptimizer(OuterConfig()).apply(b, copy.deepcopy(grads))
    assert a.sha256() == b.sha256()
    assert a.version == b.version == 1
    b.params[0][0, 0] += 1e-7
    assert a.sha256() != b.sha256()


def test_same_seed_same_initial_state():
    cfg = ModelConfig()
    assert GlobalState.from_module(build_model(cfg, 7)).sha256() == GlobalState.from_module(
        build_model(cfg, 7)).sha256()
    assert GlobalState.from_module(build_model(cfg, 7)).sha256() != GlobalState.from_module(
        build_model(cfg, 8)).sha256()


def test_pseudo_gradient_and_rebase_keep_local_progress():
    old = _tensors(5)
    local = [torch.nn.Parameter(o - 0.1) for o in old]
    delta = pseudo_gradient(old, local)
    for d in delta:
        torch.testing.assert_close(d, torch.full_like(d, 0.1))
    new = [o + 1.0 for o in old]
    rebase(local, old, new)
    after = pseudo_gradient(new, local)
    for d, d0 in zip(after, delta, strict=False):
        torch.testing.assert_close(d, d0)


def test_apply_rejects_mismatched_shapes():
    state = GlobalState(params=[torch.zeros(3)], momentum=[torch.zeros(3)])
    with pytest.raises(ValueError):
        OuterOptimizer(OuterConfig()).apply(state, [torch.zeros(4)])
    with pytest.raises(ValueError):
        OuterOptimizer(OuterConfig()).apply(state, [])
    assert state.version == 0


def test_history_tells_descendants_from_siblings_and_merge_is_deterministic():
    from p2p_diloco.core.outer import merge_lineages

    base = GlobalState(params=[torch.zeros(4)], momentum=[torch.zeros(4)])
    base.remember()
    a, b = base.copy(), base.copy()
    opt = OuterOptimizer(OuterConfig())
    opt.apply(a, [torch.full((4,), 0.1)], tokens=100)
    opt.apply(b, [torch.full((4,), -0.3)], tokens=300)
    assert a.descends_from(base.version, base.sha256()) and b.descends_from(0, base.sha256())
    assert not a.descends_from(b.version, b.sha256())  # siblings at the same version
    m1, m2 = merge_lineages(a, b), merge_lineages(b, a)
    assert m1.sha256() == m2.sha256()  # both sides of a split compute the same healed state
    assert m1.version == 2 and m1.descends_from(a.version, a.sha256()) and m1.descends_from(b.version, b.sha256())
    expected = (a.params[0].double() * 100 + b.params[0].double() * 300) / 400
    torch.testing.assert_close(m1.params[0], expected.float())
    assert m1.momentum_initialized


def test_the_token_count_saturates_below_the_records_limit():
    from p2p_diloco.core.outer import MAX_TOKENS

    state = GlobalState.from_module(torch.nn.Linear(3, 1))
    opt = OuterOptimizer(OuterConfig(lr=0.5))
    ones = [torch.ones_like(p) for p in state.params]
    opt.apply(state, ones, tokens=MAX_TOKENS - 10)
    opt.apply(state, ones, tokens=2**63 - 1)
    assert state.tokens == MAX_TOKENS - 1 and state.version == 2
    assert GlobalState.from_dict(state.to_dict()).tokens == MAX_TOKENS - 1  # still a valid state to serve


def _stepped(cfg, works, seed=3):
    """A state after a full warm-up step and then one step per entry of ``works`` on fixed outer gradients."""
    params = _tensors(seed)
    state = GlobalState(params=[p.clone() for p in params], momentum=[torch.zeros_like(p) for p in params])
    opt = OuterOptimizer(cfg)
    opt.apply(state, _tensors(seed + 1))
    for i, w in enumerate(works):
        delta = [d * (0.0 if w == 0 else 1.0) for d in _tensors(seed + 2 + i)]
        opt.apply(state, delta, work=w)
    return state


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_whole_round_is_the_step_it_always_was_and_an_empty_one_moves_nothing(nesterov):
    scaled, full = (OuterConfig(nesterov=nesterov, short_rounds=s) for s in ("scaled", "full"))
    # Work 1 (and work above 1, or not finite): bit for bit the full step, momentum and look-ahead alike.
    for w in (1.0, 3.0, float("nan")):
        a, b = _stepped(scaled, [w]), _stepped(full, [1.0])
        assert a.sha256() == b.sha256()
    # "full" ignores the work.
    assert _stepped(full, [0.2]).sha256() == _stepped(full, [1.0]).sha256()
    # Work 0 with a zero outer gradient: Θ and the momentum stay where the warm-up left them (the full step
    # would move Θ by lr·μ²·b on momentum alone).
    warm, empty, moved = _stepped(scaled, []), _stepped(scaled, [0]), _stepped(full, [0])
    for x, y in zip(warm.tensors(), empty.tensors(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert any(not torch.equal(x, z) for x, z in zip(warm.params, moved.params, strict=True))


def test_a_short_rounds_momentum_step_is_its_share_of_a_full_one():
    cfg = OuterConfig(lr=0.5, momentum=0.8, short_rounds="scaled")
    params, b0, d = _tensors(5), _tensors(6), _tensors(7)
    state = GlobalState(params=[p.clone() for p in params], momentum=[b.clone() for b in b0],
                        momentum_initialized=True)
    OuterOptimizer(cfg).apply(state, d, work=0.25)
    for p, b, p0, bb, dd in zip(state.params, state.momentum, params, b0, d, strict=True):
        b_ref = (1 - 0.25 * 0.2) * bb + dd
        torch.testing.assert_close(b, b_ref)
        torch.testing.assert_close(p, p0 - 0.5 * (dd + 0.25 * 0.8 * b_ref))


def test_a_rounds_work_is_the_weighted_mean_of_its_steps_over_h():
    assert round_work([(100.0, 60), (100.0, 60)], 60) == 1.0
    assert round_work([(300.0, 30), (100.0, 60)], 60) == pytest.approx((300 * 0.5 + 100) / 400)
    assert round_work([(100.0, 500), (100.0, 15)], 60) == pytest.approx((1 + 0.25) / 2)  # more than H counts as H
    assert round_work([(100.0, -4)], 60) == 0.0
    assert round_work([(0.0, 5)], 60) == 1.0 and round_work([], 60) == 1.0  # nothing to weigh: a whole step
    assert round_work([(float("inf"), 5)], 60) == 1.0
    assert round_work([(1.0, None), (1.0, 30)], 60) == 0.75  # a contribution without a step count: a whole one


def test_a_liar_claiming_few_steps_weighs_little_and_barely_damps_the_step():
    # Weights are bounded by the steps claimed (tokens <= steps·T): a liar claiming k steps of H weighs k/H of an
    # honest member. The worst k for one liar among n honest members leaves w = (n + x²)/(n + x), x = k/H,
    # at its minimum x = √(n² + n) − n: 0.828 for a pair, 0.928 beside three honest members.
    h = 60
    for n, floor in ((1, 0.828), (3, 0.928)):
        worst = min(round_work([(1.0, h)] * n + [(k / h, k)], h) for k in range(h + 1))
        assert worst == pytest.approx(floor, abs=2e-3)


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_long_round_passes_on_the_momentum_of_its_span(nesterov):
    # span r: the step with μ**r in place of μ (μ² = 0.81 at r = 2, bit for bit), in the decay and the look-ahead.
    decayed, full = (OuterConfig(lr=0.5, momentum=0.9, nesterov=nesterov, long_rounds=s) for s in ("decayed", "full"))
    two = OuterConfig(lr=0.5, momentum=0.9 * 0.9, nesterov=nesterov, long_rounds="full")
    params, b0, d = _tensors(5), _tensors(6), _tensors(7)

    def stepped(cfg, span):
        state = GlobalState(params=[p.clone() for p in params], momentum=[b.clone() for b in b0],
                            momentum_initialized=True)
        OuterOptimizer(cfg).apply(state, d, span=span)
        return state

    assert stepped(decayed, 2.0).sha256() == stepped(two, 1.0).sha256()
    # Span 1 (and below, or not finite) is the step it always was; "full" ignores the span.
    for span in (1.0, 0.5, float("nan"), float("inf")):
        assert stepped(decayed, span).sha256() == stepped(full, 1.0).sha256()
    assert stepped(full, 8.0).sha256() == stepped(full, 1.0).sha256()
    # The longer the span, the less the old momentum moves Θ: at 8, μ**8 = 0.43.
    if nesterov:
        for p, b, p0, bb, dd in zip(stepped(decayed, 8.0).params, stepped(decayed, 8.0).momentum, params, b0, d,
                                    strict=True):
            mu = decayed_momentum(0.9, 8.0)
            torch.testing.assert_close(b, mu * bb + dd)
            torch.testing.assert_close(p, p0 - 0.5 * (dd + mu * (mu * bb + dd)))


def test_a_momentum_decayed_to_nothing_still_restarts_the_buffer():
    # μ = 1e-6 over the longest span underflows to 0.0: the buffer must become the new outer gradient, not stay old.
    assert decayed_momentum(1e-6, MAX_SPAN) == 0.0
    params, b0, d = _tensors(5), _tensors(6), _tensors(7)
    state = GlobalState(params=[p.clone() for p in params], momentum=[b.clone() for b in b0], momentum_initialized=True)
    OuterOptimizer(OuterConfig(lr=0.5, momentum=1e-6, long_rounds="decayed")).apply(state, d, span=MAX_SPAN)
    for b, p, p0, dd in zip(state.momentum, state.params, params, d, strict=True):
        torch.testing.assert_close(b, dd)
        torch.testing.assert_close(p, p0 - 0.5 * dd)


def test_decayed_momentum_is_the_power_at_whole_spans_and_linear_between():
    assert decayed_momentum(0.9, 0.0) == 1.0 and decayed_momentum(0.9, 1.0) == 0.9
    for r in range(1, 20):
        assert decayed_momentum(0.9, float(r)) == pytest.approx(0.9**r, rel=1e-12)
        assert decayed_momentum(0.9, r + 0.5) == pytest.approx(0.9**r * 0.95, rel=1e-12)
        assert decayed_momentum(0.9, r + 0.999999) == pytest.approx(0.9 ** (r + 1), rel=1e-6)


def test_a_rounds_span_is_the_lower_median_of_its_steps_over_h():
    assert round_span([400, 400, 300, 500], 50) == 8.0  # lower median 400
    assert round_span([60, 60], 60) == 1.0 and round_span([30, 20], 60) == 1.0  # never below 1
    assert round_span([None, 120, 180], 60) == 2.0  # no count: H
    assert round_span([], 60) == 1.0 and round_span([100], 0) == 1.0
    # A liar cannot stretch the span: claiming 2^62 steps beside three honest members, or in a pair.
    assert round_span([120, 120, 120, 2**62], 60) == 2.0
    assert round_span([120, 2**62], 60) == 2.0
    assert round_span([2**62] * 3, 60) == MAX_SPAN  # a group of liars: bounded
