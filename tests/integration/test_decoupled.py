"""Decoupled DiLoCo with real learners: fragments, overlap, low-bit outer gradients, mixed speeds."""

import pytest

from .test_swarm import _assert_one_lineage

pytestmark = pytest.mark.integration

DECOUPLED = ["--set", "sync.fragments=4", "--set", "sync.overlap_steps=2", "--set", "inner.steps_per_outer=24",
             "--set", "averaging.compression=int4"]


@pytest.mark.timeout(300)
def test_fragments_with_overlap_keep_one_lineage_per_fragment(swarm):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=3, extra=DECOUPLED) for i in range(3)]
    for p in learners:
        assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, range(3), 3)
    assert len({tuple(s["fragment_sha256"]) for s in summaries}) == 1
    for s in summaries:
        assert s["versions"] == [3, 3, 3, 3]
        assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5
        assert s["outer_steps"] >= 8  # fragment rounds this learner took part in


@pytest.mark.timeout(300)
def test_slow_learner_on_the_clock_schedule_merges_its_tokens(swarm):
    """Rounds at shared wall-clock slots: a learner 3x slower joins them with fewer, fewer-weighted tokens."""
    clock = [*DECOUPLED, "--set", "sync.schedule=clock", "--set", "sync.period_seconds=24"]
    swarm.start_bootstrap()
    fast = [swarm.start_learner(i, max_outer_steps=3, extra=clock) for i in range(2)]
    slow = swarm.start_learner(2, max_outer_steps=3, extra=[*clock, "--set", "inner.extra_step_seconds=0.1"])
    for p in [*fast, slow]:
        assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, range(3), 3)
    assert summaries[2]["outer_steps"] >= 2, slow.text()  # its tokens were merged in several rounds
