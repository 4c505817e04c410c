"""sync.pace = auto (p2p_diloco/core/pace.py): the period and τ from measurements, agreed through the records."""

import math

import pytest

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.core.fragments import ClockSchedule, build_fragments
from p2p_diloco.core.pace import MAX_PERIOD, ROUNDS_KEPT, SAFETY, Pace, agreed_period, rung, switch_time
from p2p_diloco.net.progress_records import ProgressRecord, RecordError


def _pace(**kw) -> Pace:
    args = {"period": 60.0, "floor": 10.0, "fragments": 2, "steps_per_outer": 50, "lead": 8.0}
    return Pace(**{**args, **kw})


def test_rungs_are_the_floor_times_powers_of_root_two():
    assert rung(3.0, 10.0) == 10.0
    assert rung(10.0, 10.0) == 10.0
    assert rung(14.0, 10.0) == 14.142
    assert math.isclose(rung(20.0, 10.0), 20.0)  # a proposal exactly on a rung stays there
    assert rung(21.0, 10.0) == 28.284
    assert rung(1e9, 10.0) == MAX_PERIOD


def test_the_swarm_takes_the_upper_median_and_a_lying_minority_cannot_move_it_out_of_the_honest_range():
    honest = [18.0, 19.0, 20.0]
    assert agreed_period(honest, current=60.0, floor=10.0) == 20.0
    # One liar of four, either way: the result is a rung of an honest proposal.
    assert agreed_period([*honest, 1e12], current=60.0, floor=10.0) == 20.0
    assert agreed_period([*honest, 0.001], current=60.0, floor=10.0) == 20.0
    # Non-finite or absent proposals are not counted; none at all keeps the current period.
    assert agreed_period([math.nan, math.inf, 0.0, 19.0], current=60.0, floor=10.0) == 20.0
    assert agreed_period([0.0, -5.0], current=60.0, floor=10.0) == 60.0


def test_hysteresis_goes_up_at_once_and_down_only_below_half():
    assert agreed_period([35.0], current=40.0, floor=10.0) == 40.0  # a little below: kept
    assert agreed_period([21.0], current=40.0, floor=10.0) == 40.0  # above half: kept
    assert math.isclose(agreed_period([19.0], current=40.0, floor=10.0), 20.0)  # below half: down to its rung
    assert agreed_period([41.0], current=40.0, floor=10.0) == 56.569  # above: up


def test_a_change_takes_effect_at_the_same_time_for_learners_that_decide_it_a_few_seconds_apart():
    at = switch_time(20.0, 40.0, now=1001.0, lead=8.0)
    assert at == 1040.0 and at % 40.0 == 0
    assert switch_time(20.0, 40.0, now=1005.0, lead=8.0) == at
    assert switch_time(40.0, 20.0, now=1030.0, lead=8.0) == 1040.0


def test_a_pending_change_is_revised_only_upwards_or_cancelled():
    p = _pace(period=60.0)
    change = p.update([25.0], now=1000.0)
    assert change is not None and change[0] == 28.284
    assert p.update([18.0], now=1003.0) is None and p.pending == change  # lower proposals: the change stands
    assert p.update([45.0], now=1006.0) is None and p.pending is None  # the period in use is needed again: cancelled
    assert p.update([100.0], now=1009.0) == (113.137, switch_time(60.0, 113.137, 1009.0, 8.0))  # up
    assert switch_time(60.0, 113.137, 1009.0, 8.0) == pytest.approx(1018.233)
    # Further up at once when that applies no later; a larger rise due later waits for the one pending to apply
    # (1 Mbit/s, 2026-12-05: 113.1 s due in 55 s became 160 s due in 158 s).
    assert p.update([130.0], now=1012.0) is None and p.pending == (113.137, pytest.approx(1018.233))
    q = _pace(period=20.0)
    assert q.update([21.0], now=1030.0) == (28.284, switch_time(20.0, 28.284, 1030.0, 8.0))  # 37 · 28.284 = 1046.5
    assert q.update([35.0], now=1031.0) == (40.0, 1040.0)  # 40 s from 1040: sooner, so at once
    assert q.update([21.0], now=1032.0) is None and q.pending == (40.0, 1040.0)  # and only upwards


def test_a_learner_that_decided_a_change_late_takes_the_earliest_boundary_announced_for_it():
    early, late = _pace(period=20.0), _pace(period=20.0)
    assert early.update([40.0], now=1031.0) == (40.0, 1040.0)
    assert late.update([40.0], now=1033.0) == (40.0, 1080.0)  # now + lead fell past 1040: one period later
    # Announcements that do not qualify change nothing: another period, a time that is not a boundary of this
    # change, one too close to be taken, one later than ours.
    for bad in [(56.569, 1040.0), (40.0, 1050.0), (40.0, 1033.5), (40.0, 1120.0)]:
        assert late.update([40.0], now=1033.0, announced=[bad]) is None
        assert late.pending == (40.0, 1080.0)
    assert late.update([40.0], now=1034.0, announced=[(40.0, 1040.0), (40.0, 1120.0)]) == (40.0, 1040.0)
    assert late.update([40.0], now=1035.0, announced=[(40.0, 1040.0)]) is None  # already taken
    # A learner that has not decided the change takes nobody's word for it.
    undecided = _pace(period=20.0)
    assert undecided.update([20.0], now=1034.0, announced=[(40.0, 1040.0)]) is None and undecided.pending is None


def test_learners_whose_reads_differ_fall_to_the_smallest_fall_announced():
    """At 50 Mbit/s (2026-12-05) learners at 60 s read medians on both sides of a rung and fell to 20 s and
    28.3 s: their slots parted. A learner with a fall pending takes a smaller fall another learner announced,
    at that learner's time when it is a boundary of a fall from the same period."""
    deep, shallow = _pace(period=60.0), _pace(period=60.0)
    assert deep.update([19.0], now=1001.0) == (20.0, 1020.0)
    assert shallow.update([25.0], now=1003.0) == (28.284, 1020.0)
    assert deep.update([19.0], now=1005.0, announced=[(28.284, 1020.0)]) == (28.284, 1020.0)
    assert shallow.update([25.0], now=1005.0, announced=[(20.0, 1020.0)]) is None  # a deeper fall: not taken
    assert shallow.pending == (28.284, 1020.0)
    # Announcements that do not qualify: a rise, no fall at all, a time that is no boundary of a fall from
    # 60 s, one too close, one to a period that is no rung, one too shallow for any honest learner's fall (a
    # liar's fall by a hair would keep the period up).
    for bad in [(80.0, 1080.0), (60.0, 1080.0), (28.284, 1030.0), (28.284, 1005.5), (25.0, 1020.0),
                (56.569, 1020.0), (59.9, 1020.0)]:
        other = _pace(period=60.0)
        other.update([19.0], now=1005.0)
        assert other.update([19.0], now=1005.0, announced=[bad]) is None and other.pending == (20.0, 1020.0)
    # A fall is never turned into a rise by anyone's word.
    assert deep.update([19.0], now=1006.0, announced=[(80.0, 1040.0)]) is None and deep.pending == (28.284, 1020.0)


def test_a_learner_rising_takes_a_smaller_rise_another_announced_that_applies_sooner():
    """One learner's first read decides 60 → 113.1 s, the next one's (a heartbeat later) 60 → 160 s directly, due
    much later: without a rule their slots part until the second rise."""
    first, second = _pace(period=60.0), _pace(period=60.0)
    soon = first.update([100.0], now=1009.0)
    assert soon == (113.137, pytest.approx(1018.233))
    late = second.update([130.0], now=1017.0)
    assert late == (160.0, 1120.0)
    assert second.update([130.0], now=1017.0, announced=[soon]) == soon
    # Not taken: no rise (a fall or the period in use), a rung that is no rung, a time no boundary of that rise,
    # one too close, one later than ours.
    for bad in [(40.0, 1020.0), (60.0, 1080.0), (100.0, 1100.0), (113.137, 1100.0), (113.137, 1017.5),
                (113.137, 1131.37)]:
        other = _pace(period=60.0)
        other.update([130.0], now=1017.0)
        assert other.update([130.0], now=1017.0, announced=[bad]) is None and other.pending == (160.0, 1120.0)


def test_a_skipped_slot_counts_the_round_in_flight_as_one_at_least_that_long():
    """After a drop from 10 to 2 Mbit/s the period stayed at 20 s until the target (2026-12-05): three of the last
    five rounds had to end slow first. A slot skipped for a round still in flight says so at once."""
    p = _pace(t_step=0.1)
    for _ in range(ROUNDS_KEPT):
        p.observe_round(4.0, group_size=4)
    p.observe_overrun(13.0)  # a slot skipped 13 s into a round
    p.observe_round(25.0, group_size=4)  # that round ends
    assert math.isclose(p.proposal(), SAFETY * 2 * 4.0)  # two of the latest five: not yet
    p.observe_overrun(14.0)  # the next round overruns its slot too: three of five
    assert math.isclose(p.proposal(), SAFETY * 2 * 13.0)
    p.observe_overrun(math.nan)
    p.observe_overrun(-1.0)
    assert math.isclose(p.proposal(), SAFETY * 2 * 13.0)


def test_proposal_covers_h_steps_and_one_and_a_half_rounds_per_fragment_slot():
    p = _pace()
    assert p.proposal() == 0.0  # nothing measured: no proposal
    for _ in range(20):
        p.observe_step(0.4)
    # No round measured yet: still no proposal (H · t_step alone took a slow link's period down to 20 s
    # before its first round, and rounds piled up).
    assert p.proposal() == 0.0
    p.observe_round(30.0, group_size=1)  # no group formed: its duration measures a timeout, not the link
    assert p.t_round is None and p.proposal() == 0.0
    p.observe_round(5.0, group_size=4)
    assert math.isclose(p.proposal(), 50 * 0.4)  # compute-bound: H steps
    for _ in range(20):
        p.observe_round(12.0, group_size=4)
    assert math.isclose(p.proposal(), SAFETY * 2 * 12.0, rel_tol=1e-6)  # link-bound: 1.5 rounds per slot


def test_one_slow_round_does_not_move_the_proposal_most_of_the_latest_rounds_do():
    p = _pace(t_step=0.1)
    for _ in range(10):
        p.observe_round(20.0, group_size=4)
    base = p.proposal()
    assert math.isclose(base, SAFETY * 2 * 20.0)
    p.observe_round(40.0, group_size=4)  # a certificate that waited for a sketch, a download sharing the link
    p.observe_round(45.0, group_size=4)
    assert p.proposal() == base  # a moving average (weight 0.3) would have proposed 51 % more
    p.observe_round(42.0, group_size=4)  # three of the last five: the link is slower
    assert math.isclose(p.proposal(), SAFETY * 2 * 40.0)
    for _ in range(ROUNDS_KEPT):
        p.observe_round(10.0, group_size=4)
    assert math.isclose(p.proposal(), SAFETY * 2 * 10.0)  # and faster again once the latest rounds are
    first = _pace(t_step=0.1)
    first.observe_round(23.0, group_size=4)  # few rounds yet: the upper median errs long
    first.observe_round(6.0, group_size=4)
    assert first.t_round == 23.0


def test_overlap_covers_the_expected_round_within_the_slot():
    p = _pace(period=40.0)
    assert p.overlap() == 50 // 4  # nothing measured: half a slot of H / P steps
    for _ in range(20):
        p.observe_step(0.4)
        p.observe_round(4.0, group_size=3)
    assert p.overlap() == math.ceil(1.25 * 4.0 / 0.4)
    for _ in range(40):
        p.observe_round(60.0, group_size=3)
    assert p.overlap() == int(40.0 / (2 * 0.4)) - 1  # a round longer than the slot: τ stops at the slot's end
    assert _pace(period=40.0, max_overlap=5, t_step=0.4, t_round=4.0).overlap() == 5


def test_the_clock_follows_a_decided_change_at_its_time_and_stays_aligned():
    frags = build_fragments([("a", (64,)), ("b", (64,))], 2, 10)
    p = _pace(period=20.0)
    clocks = [ClockSchedule(frags, 20.0, now=1000.0), ClockSchedule(frags, 20.0, now=1000.0)]
    # Two learners decide the same change 3 s apart.
    assert p.update([38.0, 40.0], now=1001.0) is not None
    q = _pace(period=20.0)
    q.update([38.0, 40.0], now=1004.0)
    assert p.pending == q.pending
    period, at = p.pending
    assert (period, at) == (40.0, 1040.0)
    assert p.due_change(at - 0.1) is None and p.period == 20.0
    fired: list[list[tuple[float, int]]] = [[], []]
    t = 1000.0
    while t < at + 3 * period:
        t = round(t + 0.25, 2)
        for i, (pace, clock) in enumerate(zip((p, q), clocks, strict=True)):
            change = pace.due_change(t)
            if change is not None:
                clock.retime(*change)
            fired[i] += [(t, f.index) for f in clock.due(t)]
    assert fired[0] == fired[1]
    after = [(t, f) for t, f in fired[0] if t >= at]
    # The new grid's slots, strictly after the switch: fragment 1 half a period later, then fragment 0.
    assert after[:2] == [(at + period / 2, 1), (at + period, 0)]
    gaps = {round(b[0] - a[0], 2) for a, b in zip(after, after[1:], strict=False)}
    assert gaps == {round(period / 2, 2)}
    # No fragment's slot follows its previous one by less than the shorter period's half.
    for f in (0, 1):
        times = [t for t, g in fired[0] if g == f]
        assert min(b - a for a, b in zip(times, times[1:], strict=False)) >= 20.0 / 2


def test_records_carry_the_proposal_and_the_decided_change_and_refuse_bad_ones():
    r = ProgressRecord(1, "a" * 64, 10, period=24.5, switch_period=40.0, switch_at=1040.0)
    back = ProgressRecord.decode(r.encode())
    assert (back.period, back.switch_period, back.switch_at) == (24.5, 40.0, 1040.0)
    import msgpack

    for field in ("period", "switch_period", "switch_at"):
        for bad in (-1.0, float("nan"), "20", True):
            raw = msgpack.packb({**msgpack.unpackb(r.encode()), field: bad})
            with pytest.raises(RecordError, match=field):
                ProgressRecord.decode(raw)


def test_pace_auto_needs_the_clock_schedule():
    with pytest.raises(ConfigError, match="clock"):
        load_learner_config("peers/small-cpu.toml", ["sync.pace=auto"])
    cfg = load_learner_config("peers/small-cpu.toml", ["sync.pace=auto", "sync.schedule=clock"])
    assert cfg.sync.pace == "auto"


def test_the_heartbeat_agrees_on_the_period_and_remembers_proposals_a_read_missed(monkeypatch):
    from types import SimpleNamespace

    from p2p_diloco.learner.progress import Progress

    def rec(period, status="training"):
        return ProgressRecord(1, "a" * 64, 0, status, versions=(1,), shas=("a" * 64,), period=period)

    progress = Progress(SimpleNamespace(read=dict), SimpleNamespace(peer_id="me"), record_ttl=8.0,
                        pace=_pace(period=20.0))
    clock = [1000.0]
    monkeypatch.setattr("p2p_diloco.learner.progress.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("p2p_diloco.learner.progress.get_dht_time", lambda: clock[0])
    full = {"me": rec(30.0), "a": rec(38.0), "b": rec(40.0), "c": rec(80.0)}
    progress._remember(full)
    progress._agree_on_pace()
    assert progress.pace.pending == (40.0, 1040.0)  # the upper median of 30, 38, 40, 80: 40
    # A read that misses two records (the upper median of what is left would be 30) changes nothing ...
    clock[0] += 5
    progress._remember({"me": rec(30.0), "a": rec(38.0)})
    progress._agree_on_pace()
    assert progress.pace.pending == (40.0, 1040.0)
    # ... nor does one that says a learner is done; its proposal no longer counts: upper median of 30, 38, 40.
    progress._remember({**full, "c": rec(80.0, "done")})
    progress._agree_on_pace()
    assert progress.pace.pending == (40.0, 1040.0)


def test_records_carry_the_decided_change_and_the_heartbeat_takes_an_earlier_one(monkeypatch):
    from types import SimpleNamespace

    from p2p_diloco.learner.progress import Progress

    published = []
    board = SimpleNamespace(read=dict, publish=published.append)
    served = SimpleNamespace(metadata={"sha256": "a" * 64, "fragments": [{"version": 1, "sha256": "a" * 64,
                                                                          "tokens": 0}]})
    progress = Progress(board, SimpleNamespace(peer_id="me", served=served), record_ttl=8.0, pace=_pace(period=20.0))
    clock = [1033.0]
    monkeypatch.setattr("p2p_diloco.learner.progress.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("p2p_diloco.learner.progress.get_dht_time", lambda: clock[0])

    def rec(**kw):
        return ProgressRecord(1, "a" * 64, 0, "training", versions=(1,), shas=("a" * 64,), period=40.0, **kw)

    progress._remember({"me": rec(), "a": rec()})
    progress._agree_on_pace()
    assert progress.pace.pending == (40.0, 1080.0)
    progress.publish()
    assert (published[-1].switch_period, published[-1].switch_at) == (40.0, 1080.0)
    clock[0] += 1
    progress._remember({"me": rec(), "a": rec(switch_period=40.0, switch_at=1040.0)})
    progress._agree_on_pace()
    assert progress.pace.pending == (40.0, 1040.0)
