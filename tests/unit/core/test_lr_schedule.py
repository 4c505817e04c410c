import math
from types import SimpleNamespace

import pytest

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.core.lr_schedule import SchedulePosition, inner_lr
from p2p_diloco.learner.state import Counters
from p2p_diloco.train.trainer import Trainer


def _cfg(*overrides):
    return load_learner_config(None, ["inner.lr=0.01", *overrides])


def test_constant_is_the_default_and_ignores_the_position():
    cfg = _cfg()
    assert cfg.decay_steps is None
    assert {inner_lr(cfg.inner, p, cfg.decay_steps) for p in (0, 10, 10**6)} == {0.01}


def test_warmup_is_linear_then_cosine_reaches_the_floor_at_decay_steps():
    cfg = _cfg("inner.lr_schedule=cosine", "inner.warmup_steps=10", "inner.decay_steps=110", "inner.min_lr_ratio=0.1")
    lrs = [inner_lr(cfg.inner, p, cfg.decay_steps) for p in range(200)]
    assert lrs[:10] == pytest.approx([0.001 * (i + 1) for i in range(10)])
    assert lrs[10] == pytest.approx(0.01)
    assert lrs[60] == pytest.approx(0.001 + 0.009 * 0.5)  # half-way through the decay
    assert lrs[110] == pytest.approx(0.001) and lrs[199] == pytest.approx(0.001)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # never rises after warm-up


def test_cosine_decays_over_the_whole_run_by_default():
    cfg = _cfg("inner.lr_schedule=cosine", "run.max_outer_steps=4", "inner.steps_per_outer=25")
    assert cfg.decay_steps == 100
    assert inner_lr(cfg.inner, 50, cfg.decay_steps) == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi / 2)))


@pytest.mark.parametrize("overrides, words", [
    (["inner.lr_schedule=cosine"], "needs inner.decay_steps or run.max_outer_steps"),
    (["inner.lr_schedule=cosine", "inner.decay_steps=5", "inner.warmup_steps=5"], "must end after the warm-up"),
    (["inner.lr_schedule=linear"], "lr_schedule"),
    (["inner.decay_steps=100"], "applies only with inner.lr_schedule = cosine"),
])
def test_bad_schedules_are_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words) as e:
        _cfg(*overrides)
    assert "\n" not in str(e.value)


def test_the_position_follows_the_global_version():
    pos = SchedulePosition(steps_per_outer=10)
    assert [pos.step(0) for _ in range(3)] == [0, 1, 2]
    assert pos.step(1) == 10  # the swarm moved on: the schedule jumps with it
    # A learner that keeps stepping on an old version (slow, or alone) stays within that version's H steps.
    assert max(pos.step(1) for _ in range(50)) == 20
    # One that joins late starts where the swarm is, not at the warm-up.
    assert SchedulePosition(10).step(7) == 70


def test_a_resumed_position_goes_on_where_it_was():
    before = SchedulePosition(steps_per_outer=10)
    for _ in range(4):
        before.step(3)
    after = SchedulePosition(10)
    after.load(before.state())
    assert after.step(3) == 34  # not 30: the steps already taken on version 3 count
    assert after.step(4) == 40
    with pytest.raises(ValueError, match="negative"):
        after.load([3, -1])


def test_steps_are_counted_at_the_peak_lr_for_the_outlier_rule():
    """Each step adds (lr / peak lr)² to every fragment's unmerged lr_steps; a committed round takes its own off,
    a round whose own count is unknown takes its share by its steps; an old checkpoint counts steps as whole."""
    trainer = SimpleNamespace(inner_opt=SimpleNamespace(lr=5e-4), inner=SimpleNamespace(lr=1e-3))
    assert Trainer.lr_share(trainer) == 0.25  # type: ignore[arg-type]
    c = Counters()
    c.resize(2)
    for share in (0.25, 0.25, 1.0, 1.0):
        c.count_step(100, share)
    assert (c.inner_steps, c.tokens, c.steps_since_merge, c.lr_steps_since_merge) == (4, 400, [4, 4], [2.5, 2.5])
    c.merged(0, 200, 2, 2, lr_steps=0.5)  # the round took the first two steps
    c.merged(1, 200, 2, 2)  # not known which: half of them
    assert (c.steps_since_merge, c.lr_steps_since_merge) == ([2, 2], [2.0, 1.25])
    c.merged(1, 200, 2, 2, lr_steps=1.0)  # no steps left: none at the peak lr either (no drift between the two)
    assert (c.steps_since_merge[1], c.lr_steps_since_merge[1]) == (0, 0.0)
    old = Counters(steps_since_merge=[7, 3], tokens_since_merge=[1, 1], missed_versions=[0, 0])
    old.fill_lr_steps()
    assert old.lr_steps_since_merge == [7.0, 3.0]
