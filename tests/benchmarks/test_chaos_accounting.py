"""The chaos benchmark's bookkeeping (benchmarks/chaos.py): the kill schedule and the learner-seconds alive."""

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def chaos():
    return load_benchmark("chaos")


def test_the_kill_schedule_is_the_same_for_one_seed_and_stays_inside_the_run(chaos):
    a = chaos.failure_schedule(3, 4, 60.0, 300.0)
    assert a == chaos.failure_schedule(3, 4, 60.0, 300.0)
    assert a != chaos.failure_schedule(4, 4, 60.0, 300.0)
    assert all(0 < t < 300 and 0 <= i < 4 for t, i in a)
    assert [t for t, _ in a] == sorted(t for t, _ in a)


def test_a_dead_learners_downtime_leaves_the_live_time(chaos):
    live = chaos.LiveTime(3)
    live.killed(1, 10.0)
    live.killed(1, 12.0)  # already dead: the kill found nobody
    live.restarted(1, 25.0)
    live.restarted(1, 26.0)  # already alive: its start time stays
    live.killed(2, 40.0)
    # 0: 0–100; 1: 0–10 and 25–100; 2: 0–40 and dead at the end.
    assert live.total(100.0) == pytest.approx(100 + 10 + 75 + 40)
    assert live.total(100.0) == pytest.approx(live.total(100.0))  # reading it changes nothing


def test_the_failure_free_loss_is_read_off_the_line_through_two_runs_ends(chaos):
    # Between the two ends, and past the nearer one (the matched run may stop a little short or long).
    assert chaos.loss_at_tokens([(4_000, 2.0), (3_000, 2.2)], 3_500) == pytest.approx(2.1)
    assert chaos.loss_at_tokens([(3_000, 2.2), (4_000, 2.0)], 2_900) == pytest.approx(2.22)
    assert chaos.loss_at_tokens([(3_000, 2.2), (3_000, 2.1)], 3_000) is None


def test_the_matched_run_is_cut_where_its_steady_token_rate_reaches_the_target(chaos):
    clean = {"startup_seconds": [6.0, 8.0, None, 7.0], "global_tokens": 4_000}
    assert chaos.matched_duration(188.0, clean, 3_000) == pytest.approx(8.0 + 180.0 * 0.75)
    assert chaos.matched_duration(188.0, clean, 5_000) == pytest.approx(188.0)  # never longer than the clean run


def test_live_goodput_after_start_leaves_the_first_start_ups_out_of_the_live_seconds(chaos):
    # Two learners, 100 s: one alive throughout (started in 5 s), one killed at 3 s during its start-up and
    # down for 10 s; useful work 160 learner-s.
    live = 100.0 + (100.0 - 10.0)
    assert chaos.live_after_start(160.0, live, [5.0, 3.0]) == pytest.approx(160.0 / (190.0 - 8.0))
    assert chaos.live_after_start(160.0, 8.0, [5.0, 3.0]) is None  # nothing left after the start-ups


def test_the_never_killed_goodput_counts_only_the_learners_no_kill_hit(chaos):
    # Learner 0 killed; 1 merged 90 of 100 steps of 0.5 s; 2 merged all 100 steps of 0.8 s. 100 s run.
    counters = [{"steps_merged": 10, "compute_seconds": 50.0, "inner_steps": 100},
                {"steps_merged": 90, "compute_seconds": 50.0, "inner_steps": 100},
                {"steps_merged": 100, "compute_seconds": 80.0, "inner_steps": 100}]
    useful = [chaos._useful(c) for c in counters]
    assert useful == pytest.approx([5.0, 45.0, 80.0])
    assert chaos.never_killed_goodput(useful, {0}, 100.0) == pytest.approx((45.0 + 80.0) / 200.0)
    assert chaos.never_killed_goodput(useful, {0, 1, 2}, 100.0) is None
