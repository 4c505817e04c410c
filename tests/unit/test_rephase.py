"""Steps schedule: a learner whose round failed joins a round the others are forming
(``Rounds.rephase``) and keeps that phase afterwards."""

import time
from types import SimpleNamespace

import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.fragments import build_fragments
from p2p_diloco.learner_state import LearnerState
from p2p_diloco.rounds import Rounds

from .fake_averaging import FakeAveraging

H, P = 20, 4


def _learner(searching: dict[tuple[int, int], int], steps: int) -> Rounds:
    cfg = load_learner_config(None, [f"inner.steps_per_outer={H}", f"sync.fragments={P}", "sync.overlap_steps=2",
                                     "averaging.matchmaking_time=3"])
    fragments = build_fragments([(f"w{i}", torch.Size([10])) for i in range(P)], P, H)
    state = LearnerState(fragments=fragments, states=[SimpleNamespace(version=7) for _ in range(P)], params=[])
    state.counters.inner_steps = steps
    none = SimpleNamespace()
    return Rounds(cfg, state, FakeAveraging(searching=searching), none, none, None, none, none, lambda: None)


def _due_steps(learner: Rounds, fragment: int, steps: range) -> list[int]:
    out = []
    for s in steps:
        learner.state.counters.inner_steps = s
        if any(f.index == fragment for f in learner.due()):
            out.append(s)
    return out


def test_in_phase_no_dht_look():
    learner = _learner({(2, 7): 1}, steps=103)
    learner.rephase()
    assert learner.averaging.looks == 0 and not learner.pending


def test_out_of_phase_joins_the_round_the_others_form_and_keeps_their_phase():
    learner = _learner({(2, 7): 1}, steps=103)  # fragment 2's own slot is at step % 20 == 10
    learner.out_of_phase = True
    learner.rephase()
    assert list(learner.pending) == [2]  # started by sync_due_fragments in the same call
    assert [f.index for f in learner.due()] == [2]  # due now on the moved schedule: no second start
    # From now on every fragment is due H steps apart, fragment 2 at 103, 123, ... and the others
    # H/P apart from it, as on the others' schedule.
    assert _due_steps(learner, 2, range(104, 150)) == [123, 143]
    assert _due_steps(learner, 3, range(104, 150)) == [108, 128, 148]


def test_looks_at_most_once_per_matchmaking_time_and_not_while_a_round_runs():
    learner = _learner({}, steps=55)
    learner.out_of_phase = True
    learner.rephase()
    assert learner.averaging.looks == P and not learner.pending and learner.phase_shift == 0
    learner.rephase()
    assert learner.averaging.looks == P  # too soon
    learner.next_phase_look = time.monotonic() - 1
    learner.inflight = object()
    learner.rephase()
    assert learner.averaging.looks == P  # our own round is running
    learner.inflight = None
    learner.averaging.searching = {(0, 7): 2}
    learner.rephase()
    assert list(learner.pending) == [0] and (55 + learner.phase_shift) % H == 0


def test_fragments_at_the_target_version_are_not_joined():
    learner = _learner({(1, 7): 1}, steps=55)
    learner.cfg.run.max_outer_steps = 7
    learner.out_of_phase = True
    learner.rephase()
    assert not learner.pending
