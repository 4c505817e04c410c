"""A learner whose training diverges takes the global state back, with a real model, trainer and fault."""

import math

import pytest
import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.core.outer import GlobalState
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.healing import MAX_HEALS, WINDOW_ROUNDS, Healing
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.sim.faults import FaultPlan
from p2p_diloco.train.models.gpt import build_model
from p2p_diloco.train.trainer import Trainer, resolve_placement

H = 5


def _learner():
    cfg = load_learner_config("peers/small-cpu.toml", [f"inner.steps_per_outer={H}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 0)
    trainer = Trainer(model, cfg, resolve_placement(cfg.run))
    named = [(n, p.shape) for n, p in model.named_parameters()]
    fragments = build_fragments(named, 2, H)
    states = [GlobalState([trainer.params[i].detach().clone() for i in f.tensor_indices],
                          [torch.zeros_like(trainer.params[i]) for i in f.tensor_indices]) for f in fragments]
    state = LearnerState(fragments=fragments, states=states, params=trainer.params, peer_id="me")
    state.counters.resize(2)
    return cfg, trainer, state


def _batch(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4, cfg.model.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def test_a_diverged_step_takes_the_global_state_back_and_training_goes_on():
    cfg, trainer, state = _learner()
    faults, healing = FaultPlan.parse("poison at round 1 with diverge"), Healing(H)
    losses = []
    for step in range(6):
        x, y = _batch(cfg, step)
        loss = trainer.step(x, y, 0, on_gradients=lambda ps: faults.inner_gradients(ps, 1))
        losses.append(loss)
        if healing.after_step(loss, state, trainer):
            continue
        state.counters.count_step(x.numel(), trainer.lr_share())
    # Step 0's NaN gradients poison θ; step 1's loss is NaN: it heals (θ = Θ, fresh optimizer), then trains on.
    assert math.isfinite(losses[0]) and not math.isfinite(losses[1]) and all(map(math.isfinite, losses[2:]))
    assert healing.heals == 1
    assert all(torch.isfinite(p).all() for p in trainer.params)
    # The poisoned steps are not claimed; the four after the heal are.
    assert state.counters.steps_since_merge == [4, 4]
    assert trainer.rewarm_steps == cfg.inner.rejoin_warmup_steps or trainer.inner_opt.steps_taken() == 4


def test_the_state_taken_back_is_the_global_one():
    cfg, trainer, state = _learner()
    with torch.no_grad():
        for p in trainer.params:
            p.fill_(float("nan"))
    assert Healing(H).after_step(float("nan"), state, trainer)
    for frag, g in zip(state.fragments, state.states, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(state.local(frag), g.params, strict=True))
    assert state.changed == {0, 1} and trainer.inner_opt.steps_taken() == 0


def test_a_learner_that_keeps_diverging_stops_with_a_clear_error():
    _, trainer, state = _learner()
    healing = Healing(H)
    for _ in range(MAX_HEALS - 1):
        assert healing.after_step(float("inf"), state, trainer)
        state.counters.inner_steps += 1
    with pytest.raises(LearnerError, match=f"diverged .* {MAX_HEALS} times within {WINDOW_ROUNDS * H} inner steps"):
        healing.after_step(float("nan"), state, trainer)


def test_divergences_far_apart_are_each_healed():
    _, trainer, state = _learner()
    healing = Healing(H)
    for _ in range(2 * MAX_HEALS):
        assert healing.after_step(float("nan"), state, trainer)
        state.counters.inner_steps += WINDOW_ROUNDS * H
    assert healing.heals == 2 * MAX_HEALS
    assert not healing.after_step(1.0, state, trainer)


def test_an_eval_loss_far_above_the_last_one_is_reported(caplog):
    import logging
    from types import SimpleNamespace

    from p2p_diloco.learner.loop import Learner
    from p2p_diloco.learner.metrics import Metrics

    cfg, _, state = _learner()
    events = []
    metrics = Metrics()
    parts = SimpleNamespace(metrics=metrics, state=state, audit=SimpleNamespace(record=lambda e, **f: events.append(e)))
    learner = SimpleNamespace(parts=parts, cfg=cfg)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.learner.loop"):
        for loss in (5.5, 3.3, 3.1, 4.0, 14.85, 2.9, float("nan"), 2.8):  # 14.85: a poisoned round's (security.md)
            Learner._watch_loss(learner, loss)  # type: ignore[arg-type]
            metrics.last_eval_loss = loss
    assert state.counters.loss_rises == 1 and events == ["loss_rose"]  # 3.1 → 4.0 is within the default 50%
    assert [r.getMessage()[:40] for r in caplog.records] == ["eval loss rose from 4.0000 to 14.8500 (m"]
    cfg.run.loss_rise_alert = None  # off
    Learner._watch_loss(learner, 100.0)  # type: ignore[arg-type]
    assert state.counters.loss_rises == 1
