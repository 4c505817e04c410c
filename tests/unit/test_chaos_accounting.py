"""The chaos benchmark's bookkeeping (benchmarks/chaos.py): the kill schedule and the learner-seconds alive."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
