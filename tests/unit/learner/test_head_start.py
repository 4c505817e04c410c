"""The head start: work on a thread while the DHT joins, held between units for a fork, its errors raised at
the end; a learner's head start evaluates, and steps only from a checkpoint, never across a round or an
outer step's end."""

import threading

import pytest

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.fragments import due_fragments
from p2p_diloco.learner.head_start import HeadStart
from p2p_diloco.learner.loop import Learner
from p2p_diloco.learner.startup import build, load_data
from p2p_diloco.train.data.tokenizer import load_tokenizer


@pytest.mark.timeout(20)
def test_work_runs_until_it_says_it_is_done():
    left = [3]

    def work() -> bool:
        left[0] -= 1
        return left[0] > 0

    head = HeadStart(work).start()
    head.finish()
    assert left == [0]


@pytest.mark.timeout(20)
def test_no_unit_of_work_runs_while_paused_and_finish_ends_endless_work():
    inside = threading.Event()  # set while paused() holds
    ran = threading.Event()  # set by every unit
    overlaps, units = [], []

    def work() -> bool:
        overlaps.append(inside.is_set())
        units.append(1)
        ran.set()
        return True

    head = HeadStart(work).start()
    for _ in range(20):
        assert ran.wait(10)  # the worker is running units right before the pause
        with head.paused():
            inside.set()
            ran.clear()
            done = len(units)
            assert not ran.wait(0.005) and len(units) == done  # held between two units
            inside.clear()
        ran.clear()
    assert ran.wait(10)  # and it resumed after the last pause
    head.finish()
    assert not any(t.name == "head-start" for t in threading.enumerate())  # finish joined the worker
    assert len(units) >= 21 and not any(overlaps)


@pytest.mark.timeout(20)
def test_an_error_in_the_work_is_raised_by_finish_and_dropped_by_stop():
    def work() -> bool:
        raise ValueError("bad batch")

    head = HeadStart(work).start()
    with pytest.raises(ValueError, match="bad batch"):
        head.finish()
    head.finish()  # raised once
    quiet = HeadStart(work).start()
    quiet.stop()


def _parts(*overrides: str):
    cfg = load_learner_config("peers/small-cpu.toml", ["inner.batch_size=4", "model.seq_len=32", "data.eval_batches=1",
                                                       "inner.steps_per_outer=12", "sync.fragments=2", *overrides])
    trainer, state = build(cfg)
    return cfg, trainer, state, load_data(cfg, 0, load_tokenizer(cfg.data.tokenizer))


@pytest.mark.timeout(60)
def test_a_fresh_learner_only_evaluates_while_it_joins():
    cfg, trainer, state, data = _parts()
    learner = Learner(cfg)
    head = learner._head_start(trainer, state, data, resumed=False)
    head.start().finish()
    assert state.counters.first_eval_loss is not None and state.counters.inner_steps == 0


def _resumed(trainer, data, state, steps: int) -> None:
    """As restored from a checkpoint after ``steps`` inner steps: the optimizer has stepped."""
    x, y = data.sampler.next_batch()
    trainer.step(x, y, 0)
    state.counters.inner_steps = steps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["steps", "clock"])
def test_a_resumed_learner_steps_up_to_its_next_round_or_outer_step_end(schedule):
    cfg, trainer, state, data = _parts(f"sync.schedule={schedule}")
    h = cfg.inner.steps_per_outer
    _resumed(trainer, data, state, h + 1)
    learner = Learner(cfg)
    head = learner._head_start(trainer, state, data, resumed=True)
    head.start()
    head._thread.join(timeout=30)  # stops on its own
    head.finish()
    c = state.counters
    stop = c.inner_steps + 1  # the step it left to the training loop
    assert c.inner_steps > h + 1 and c.first_eval_loss is not None
    assert c.steps_since_merge == [c.inner_steps - h - 1] * 2 and c.compute_seconds > 0
    assert c.lr_steps_since_merge == pytest.approx(c.steps_since_merge)  # a constant lr: each step counts as one
    if schedule == "steps":  # the next fragment's round is the training loop's
        assert due_fragments(state.fragments, stop, h) and not any(
            due_fragments(state.fragments, s, h) for s in range(h + 2, stop))
    else:  # rounds are at wall-clock slots: up to the outer step's end
        assert stop == 2 * h
    assert len(learner._head_losses) == c.inner_steps - h - 1 and learner._head_seconds > 0


@pytest.mark.timeout(60)
def test_a_signal_a_finished_run_a_never_stepped_optimizer_or_a_unit_of_several_workers_takes_no_steps():
    cfg, trainer, state, data = _parts("run.max_outer_steps=2")
    state.counters.first_eval_loss = 1.0
    # A checkpoint whose AdamW never stepped: the first step must see the swarm's version (the lr ramp).
    Learner(cfg)._head_start(trainer, state, data, resumed=True).start().finish()
    assert state.counters.inner_steps == 0
    _resumed(trainer, data, state, 7)  # the next round is at step 12
    learner = Learner(cfg)
    learner.stop.set()
    learner._head_start(trainer, state, data, resumed=True).start().finish()
    assert state.counters.inner_steps == 7
    for s in state.states:  # at run.max_outer_steps: it only serves, and trains no more
        s.version = 2
    Learner(cfg)._head_start(trainer, state, data, resumed=True).start().finish()
    assert state.counters.inner_steps == 7
    for s in state.states:
        s.version = 1
    Learner(cfg)._head_start(trainer, state, data, resumed=True).start().finish()
    assert state.counters.inner_steps > 7
    assert Learner(cfg, unit=object())._head_start(trainer, state, data, resumed=True) is None  # type: ignore[arg-type]
