"""Steps schedule: a learner whose round failed joins a round the others are forming
(``Rounds.rephase``) and keeps that phase afterwards."""

import time
from types import SimpleNamespace

import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.learner.schedule import Rounds
from p2p_diloco.learner.state import LearnerState
from tests.unit.fake_averaging import FakeAveraging

H, P = 20, 4


def _learner(searching: dict[tuple[int, int], int], steps: int, overlap: int = 2) -> Rounds:
    cfg = load_learner_config(None, [f"inner.steps_per_outer={H}", f"sync.fragments={P}",
                                     f"sync.overlap_steps={overlap}", "averaging.matchmaking_time=3"])
    fragments = build_fragments([(f"w{i}", torch.Size([10])) for i in range(P)], P, H)
    state = LearnerState(fragments=fragments, states=[SimpleNamespace(version=7) for _ in range(P)], params=[])
    state.counters.inner_steps = steps
    state.counters.resize(P)
    state.counters.steps_since_merge = [5] * P
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
    learner.phase.out = False  # our last round committed
    learner.rephase()
    assert learner.averaging.looks == 0 and not learner.pending


def test_a_learner_that_just_started_joins_the_swarms_round_once_it_has_steps_to_give():
    learner = _learner({(2, 7): 1}, steps=0)
    learner.state.counters.steps_since_merge = [0] * P
    learner.rephase()  # no phase yet, but nothing to contribute
    assert not learner.pending
    learner.state.counters.inner_steps, learner.state.counters.steps_since_merge = 4, [4] * P
    learner.phase.next_look = 0.0
    learner.rephase()
    assert list(learner.pending) == [2] and [f.index for f in learner.due()] == [2]


def test_out_of_phase_joins_the_round_the_others_form_and_keeps_their_phase():
    learner = _learner({(2, 7): 1}, steps=103)  # fragment 2's own slot is at step % 20 == 10
    learner.phase.out = True
    learner.rephase()
    assert list(learner.pending) == [2]  # started by sync_due_fragments in the same call
    assert [f.index for f in learner.due()] == [2]  # due now on the moved schedule: no second start
    # From now on every fragment is due H steps apart, fragment 2 at 103, 123, ... and the others
    # H/P apart from it, as on the others' schedule.
    assert _due_steps(learner, 2, range(104, 150)) == [123, 143]
    assert _due_steps(learner, 3, range(104, 150)) == [108, 128, 148]


def test_looks_at_most_once_per_matchmaking_time_and_not_while_a_round_runs():
    learner = _learner({}, steps=55)
    learner.phase.out = True
    learner.rephase()
    assert learner.averaging.looks == P and not learner.pending and learner.phase.shift == 0
    learner.rephase()
    assert learner.averaging.looks == P  # too soon
    learner.phase.next_look = time.monotonic() - 1
    learner.inflight = object()
    learner.rephase()
    assert learner.averaging.looks == P  # our own round is running
    learner.inflight = None
    learner.averaging.searching = {(0, 7): 2}
    learner.rephase()
    assert list(learner.pending) == [0] and (55 + learner.phase.shift) % H == 0


def test_fragments_at_the_target_version_are_not_joined():
    learner = _learner({(1, 7): 1}, steps=55)
    learner.cfg.run.max_outer_steps = 7
    learner.phase.out = True
    learner.rephase()
    assert not learner.pending


def test_a_learner_late_for_the_swarms_round_takes_its_state_and_waits_for_its_next_round():
    """Each late learner starting a round at the new version at once split 8 learners into two halves
    whose rounds took turns (benchmarks/scale_swarm.py): a late learner now joins the swarm's next round."""
    learner = _learner({}, steps=110, overlap=0)  # fragment 2's slot (step % 20 == 10): due now
    learner.phase.out = False  # in phase until now
    adopted = []

    def start(background=False):
        adopted.append(background)
        learner.state.states[2].version = 8  # the swarm committed version 8 while we trained
        return [2]

    learner.catch_up = SimpleNamespace(start=start, downloading=lambda f: False)
    learner.sync_due_fragments()
    assert adopted == [False]  # τ = 0: the state is taken before the round would start
    assert learner.inflight is None and learner.averaging.looks == 0  # no round of our own at version 8
    assert learner.phase.out and not learner.pending
    # The swarm's next round of fragment 2 forms: we join it at once (the look is not rate-limited).
    learner.averaging.searching = {(2, 8): 3}
    learner.state.counters.inner_steps = 113
    learner.rephase()
    assert list(learner.pending) == [2] and (113 + learner.phase.shift) % H == 10


def test_after_two_late_slots_in_a_row_a_learner_rounds_at_once_and_a_merge_is_no_lateness():
    learner = _learner({}, steps=110, overlap=0)
    started = []
    learner.start = lambda frag, background=None, search_seconds=None: started.append(frag.index)
    merged = []

    def start(background=False):
        learner.state.states[2].version += 1
        if merged:
            learner.state.counters.merges += 1
        return [2]

    learner.catch_up = SimpleNamespace(start=start, downloading=lambda f: False)
    frag = learner.state.fragments[2]
    learner._open_slot(frag)
    learner._open_slot(frag)
    assert started == [] and learner.phase.waits == 2
    learner._open_slot(frag)  # a third late slot without a commit: as before, a round at once
    assert started == [2]
    learner.phase.waits = 0
    merged.append(True)  # a split-brain merge changed the fragment: not late, a round at once
    learner._open_slot(frag)
    assert started == [2, 2] and learner.phase.waits == 0


def test_on_the_clock_schedule_a_learner_that_took_a_state_at_its_slot_rounds_in_it():
    learner = _learner({}, steps=110, overlap=0)
    learner.clock = object()  # everyone's slot is the same wall-clock time
    learner.phase.out = False
    started = []
    learner.start = lambda frag, background=None, search_seconds=None: started.append(frag.index)
    learner.catch_up = SimpleNamespace(start=lambda background=False: [2], downloading=lambda f: False)
    learner._open_slot(learner.state.fragments[2])
    assert started == [2] and not learner.phase.out


class _Clock:
    """A clock schedule whose due fragments the test sets."""

    def __init__(self):
        self.now: list[int] = []

    def due(self, now):
        due, self.now = self.now, []
        return [SimpleNamespace(index=f) for f in due]


def _on_the_clock(searching):
    learner = _learner(searching, steps=110, overlap=2)
    learner.clock, learner.phase.out = _Clock(), False
    learner.catch_up = SimpleNamespace(start=lambda background=False: [], downloading=lambda f: False)
    started = []
    learner.start = lambda frag, background=None, search_seconds=None: started.append((frag.index, search_seconds))
    running = [True]
    learner.inflight = SimpleNamespace(running=lambda: running[0], fragment=SimpleNamespace(index=1))

    def finish():
        learner.inflight = None

    learner.finish = finish
    return learner, started, running


def test_a_slot_opened_late_joins_a_search_in_progress_or_searches_only_within_its_window(caplog):
    """At 1 Mbit/s three learners skipped a slot while their round ran on past its patience; the fourth, whose
    round ended a few seconds sooner, opened it and searched alone for 31 s (WAN benchmark, 2026-12-05)."""
    for searching, expected in (({}, [(2, 3.0)]), ({(2, 7): 2}, [(2, None)])):
        learner, started, running = _on_the_clock(searching)
        learner.clock.now = [2]
        learner.sync_due_fragments()  # fragment 1's round still runs: the slot waits (its patience)
        assert started == [] and list(learner.pending) == [2] and learner.late == {2}
        assert learner.averaging.looks == 0
        running[0] = False  # it ended within the patience: the slot opens late, after a look in the DHT
        with caplog.at_level("INFO", logger="p2p_diloco.learner.schedule"):
            learner.sync_due_fragments()
        # Alone: a search of the matchmaking time (3 s), where other latecomers can still meet us; else a round.
        assert started == expected and learner.averaging.looks == 1 and not learner.pending and not learner.late
        assert ("nobody is looking for a group of it at version 7" in caplog.text) == (expected[0][1] is not None)
        caplog.clear()


def test_a_slot_skipped_after_its_patience_leaves_no_late_mark_on_the_next():
    learner, started, running = _on_the_clock({})
    overruns: list[float] = []
    learner.pace = SimpleNamespace(observe_overrun=overruns.append, due_change=lambda now: None, overlap=lambda: 2)
    learner.inflight.started, learner.inflight.overran = time.perf_counter() - 12.0, False
    learner.clock.now = [2]
    learner.sync_due_fragments()
    learner.pending[2] = time.monotonic() - 1  # its patience ran out: skipped
    learner.averaging.in_group = False  # still searching: its length measures the search, not the link
    learner.sync_due_fragments()
    assert started == [] and not learner.pending and not learner.late and overruns == []
    learner.averaging.in_group = True  # in its all-reduce: the pace hears of a round that outlived its slot, once
    for _ in range(2):
        learner.clock.now = [2]
        learner.sync_due_fragments()
        learner.pending[2] = time.monotonic() - 1
        learner.sync_due_fragments()
    assert len(overruns) == 1 and 12.0 <= overruns[0] < 20.0
    running[0] = False
    learner.clock.now = [2]  # the next slot, on time: no look, a full search
    learner.sync_due_fragments()
    assert started == [(2, None)] and learner.averaging.looks == 0


def test_a_slot_opened_on_time_starts_without_a_look():
    learner, started, running = _on_the_clock({})
    running[0] = False  # the round before ended before the slot
    learner.clock.now = [2]
    learner.sync_due_fragments()
    assert started == [(2, None)] and learner.averaging.looks == 0


def test_a_failed_look_lets_a_late_slot_search_its_full_time():
    learner, started, running = _on_the_clock({})

    def broken(fragment, version):
        raise TimeoutError("dht")

    learner.averaging.searching_peers = broken
    learner.clock.now = [2]
    learner.sync_due_fragments()
    running[0] = False
    learner.sync_due_fragments()
    assert started == [(2, None)]
