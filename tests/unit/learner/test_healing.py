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
