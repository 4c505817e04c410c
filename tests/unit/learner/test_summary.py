"""The end-of-run verdict of `p2p-diloco swarm` and `p2p-diloco regions`."""

from p2p_diloco.sim.local_swarm import lineage_verdict


def _s(versions, shas, whole=None):
    return {"versions": versions, "fragment_sha256": shas, "version": min(versions),
            "global_state_sha256": whole or "|".join(shas)}


def test_identical_learners():
    ok, line = lineage_verdict([_s([5, 5], ["a", "b"])] * 3, "3 learners")
    assert ok and line == "all 3 learners hold the same global state"


def test_learners_one_round_apart_are_consistent_if_each_fragment_version_has_one_state():
    ok, line = lineage_verdict([_s([16, 16], ["a", "b"]), _s([16, 17], ["a", "c"]), _s([17, 17], ["d", "c"])],
                               "3 learners")
    assert ok and "one state per fragment version" in line and "16, 17" in line


def test_two_states_of_one_fragment_version_is_a_split():
    ok, line = lineage_verdict([_s([7, 7], ["a", "b"]), _s([7, 7], ["a", "x"])], "2 learners")
    assert not ok and "fragment 1 version 7 (2 states)" in line


def test_no_summaries():
    assert lineage_verdict([], "2 learners") == (False, "no learner wrote a summary")
