"""The end-of-run verdict of `p2p-diloco swarm` and `p2p-diloco regions`."""

from p2p_diloco.local_swarm import lineage_verdict


def test_one_version_one_state():
    ok, line = lineage_verdict({5: {"a"}}, "3 learners")
    assert ok and line == "all 3 learners hold the same global state"


def test_learners_stopped_at_different_versions_are_consistent_if_each_version_has_one_state():
    ok, line = lineage_verdict({19: {"a"}, 21: {"b"}}, "4 learners")
    assert ok and "one global state per version" in line and "19, 21" in line


def test_two_states_at_one_version_is_a_split():
    ok, line = lineage_verdict({7: {"a", "b"}, 8: {"c"}}, "4 learners")
    assert not ok and "version 7 (2 states)" in line


def test_no_summaries():
    assert lineage_verdict({}, "2 learners") == (False, "no learner wrote a summary")
