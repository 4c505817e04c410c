"""``sync.max_steps_per_round``: on the clock schedule a learner stops adding inner steps to a fragment's
next outer gradient at the bound and waits for that fragment's next slot (``Rounds.pause_at_the_bound``)."""

from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.fragments import ClockSchedule, build_fragments
from p2p_diloco.learner_state import LearnerState
from p2p_diloco.rounds import Rounds

H, P, BOUND = 20, 2, 40
CLOCK = ["sync.schedule=clock", "sync.period_seconds=60", f"sync.fragments={P}", f"inner.steps_per_outer={H}"]


def _rounds(bound: int | None = BOUND, clock: bool = True) -> Rounds:
    sets = [*CLOCK] if clock else [f"sync.fragments={P}", f"inner.steps_per_outer={H}"]
    if bound is not None:
        sets.append(f"sync.max_steps_per_round={bound}")
    cfg = load_learner_config(None, sets)
    fragments = build_fragments([(f"w{i}", torch.Size([10])) for i in range(P)], P, H)
    state = LearnerState(fragments=fragments, states=[SimpleNamespace(version=3) for _ in range(P)], params=[])
    state.counters.resize(P)
    schedule = ClockSchedule(fragments, 60.0, now=0.0) if clock else None
    none = SimpleNamespace()
    return Rounds(cfg, state, none, none, none, schedule, none, none, lambda: None)


def _in_flight(fragment: int, steps: int, running: bool) -> SimpleNamespace:
    return SimpleNamespace(fragment=SimpleNamespace(index=fragment), steps=steps, running=lambda: running)


def test_a_fragment_whose_unsent_steps_reach_the_bound_is_held():
    r = _rounds()
    r.state.counters.steps_since_merge[:] = [BOUND - 1, 10]
    assert r.at_the_bound() == []
    r.state.counters.steps_since_merge[:] = [BOUND, 10]
    assert r.at_the_bound() == [0]
    r.state.counters.steps_since_merge[:] = [BOUND + 5, 3 * BOUND]
    assert r.at_the_bound() == [0, 1]


def test_steps_already_sent_in_a_round_do_not_count_until_it_fails():
    r = _rounds()
    r.state.counters.steps_since_merge[:] = [BOUND + 7, 0]
    r.inflight = _in_flight(0, BOUND, running=True)  # the round took BOUND steps; 7 came after it started
    assert r.carried(0) == 7 and r.at_the_bound() == []
    r.inflight, r.detached = None, _in_flight(0, BOUND, running=True)
    assert r.carried(0) == 7 and r.at_the_bound() == []
    r.detached = None  # it ended without a commit: its steps are unsent again
    assert r.carried(0) == BOUND + 7 and r.at_the_bound() == [0]


def test_no_bound_without_the_setting_at_the_target_or_on_the_steps_schedule():
    r = _rounds(bound=None)
    r.state.counters.steps_since_merge[:] = [10_000, 10_000]
    assert r.at_the_bound() == []
    r = _rounds()
    r.cfg.run.max_outer_steps = 3  # every fragment at version 3: no more rounds to wait for
    r.state.counters.steps_since_merge[:] = [10_000, 10_000]
    assert r.at_the_bound() == []
    with pytest.raises(ConfigError, match="max_steps_per_round needs sync.schedule = clock"):
        _rounds(clock=False)


def test_the_pause_ticks_the_rounds_until_the_slot_starts_a_round_and_counts_as_waiting():
    r = _rounds()
    r.state.counters.steps_since_merge[:] = [BOUND, 0]
    ticks = []

    def tick(idle=False):
        ticks.append(idle)
        if len(ticks) == 3:  # fragment 0's slot: its round starts with the steps it carried
            r.inflight = _in_flight(0, BOUND, running=True)

    r.tick = tick
    paused = r.pause_at_the_bound(lambda: False, poll=0.001)
    assert ticks == [True, True, True] and r.at_the_bound() == []
    assert paused > 0 and r.state.counters.wait_seconds == pytest.approx(paused)
    assert r.pause_at_the_bound(lambda: False) == 0.0  # not at the bound: no pause, no tick
    assert len(ticks) == 3


def test_a_stop_ends_the_pause():
    r = _rounds()
    r.state.counters.steps_since_merge[:] = [BOUND, 0]
    r.tick = lambda idle=False: None
    calls = []
    r.pause_at_the_bound(lambda: calls.append(1) or len(calls) > 2, poll=0.001)
    assert len(calls) == 3 and r.at_the_bound() == [0]


def test_idle_ticks_apply_a_round_that_has_ended_before_its_tau_steps():
    r = _rounds()
    finished = []
    r.finish = lambda: finished.append(r.inflight)
    r.catch_up = SimpleNamespace(poll=lambda busy=None: None)
    r.poll_detached = r.sync_due_fragments = lambda: None
    r.inflight = _in_flight(0, BOUND, running=True)
    r.inflight.apply_at = 10**6
    r.tick(idle=True)
    assert finished == []  # still running
    r.tick()
    assert finished == []
    r.inflight.running = lambda: False
    r.tick()
    assert finished == []  # after a step: at apply_at, τ steps after it started
    r.tick(idle=True)
    assert len(finished) == 1  # no step is coming: applied now
