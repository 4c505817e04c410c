"""More learners than one group's target: with a majority quorum, learners whose
``averaging.target_group_size`` is below half the swarm still never commit one version twice."""

from collections import defaultdict

import pytest

from .harness import audit_events


@pytest.mark.timeout(480)
def test_eight_learners_with_groups_of_four_keep_one_state_per_version(swarm):
    swarm.start_bootstrap()
    # Groups of 4 are below a majority of 8: under the default quorum (majority) a group closes early only at 5.
    extra = ["--set", "averaging.target_group_size=4",
             "--set", "inner.extra_step_seconds=0.03", "--set", "run.eval_every=1000000",
             "--set", "run.linger_seconds=30"]
    learners = [swarm.start_learner(i, max_outer_steps=3, extra=[*extra, "--shard-index", str(i % 4)])
                for i in range(8)]
    for p in learners:
        assert p.wait(420) == 0, p.text()
    results: dict[tuple[int, int], set[str]] = defaultdict(set)
    for p in learners:
        for e in audit_events(p, "committed"):
            results[(e["fragment"], e["version_after"])].add(e["sha_after"])
    assert results, "no round was committed"
    # After every round, one global state per fragment version: every learner that committed it holds the same.
    assert all(len(shas) == 1 for shas in results.values()), dict(results)
    summaries = [swarm.summary(i) for i in range(8)]
    assert len({s["global_state_sha256"] for s in summaries}) == 1, summaries
    assert {s["version"] for s in summaries} == {3}
