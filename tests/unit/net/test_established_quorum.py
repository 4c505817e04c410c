"""The averager's quorum check counts established contributions (p2p_diloco/core/standing.py)."""

import pickle
from types import SimpleNamespace

import pytest
from hivemind.averaging.allreduce import AllreduceException

from p2p_diloco.core.exclusion import Verdict
from p2p_diloco.net.averager_process import OuterGradientAverager, RefusedPeers, inflated_claims


def test_a_group_needs_the_quorum_in_established_contributions():
    """The averager's check before any part is sent: a group of two established learners and four fresh keys
    has 6 members but 2 established contributions, below a quorum of 3; with 3 established it runs."""
    averager = OuterGradientAverager.__new__(OuterGradientAverager)  # the check alone: no process, no DHT
    averager._base_quorum, averager._established_after, averager._running_groups = 2, 4, {}
    averager.dht = SimpleNamespace(peer_id="h1")
    averager._standing = {"h1": 5, "h2": 5, "h3": 5}
    members = ["h1", "h2", "s1", "s2", "s3", "s4"]
    group = SimpleNamespace(peer_ids=members, group_id=b"g")
    gathered = {p: {"quorum": 3, "established": 3} for p in members}  # 3 established learners train
    with pytest.raises(AllreduceException, match="2 established contribution"):
        averager._check_quorum(Verdict(), group, gathered)
    averager._check_quorum(Verdict(), SimpleNamespace(peer_ids=[*members, "h3"], group_id=b"g"), gathered)
    # Fewer than K established learners train (the group's upper median of the claims): everyone counts.
    averager._check_quorum(Verdict(), group, {p: {"quorum": 3, "established": 1} for p in members})
    averager._standing = {}  # the founding: everyone counts
    averager._check_quorum(Verdict(), group, gathered)


def test_a_pair_that_fails_on_an_inflated_quorum_claim_names_the_claimant():
    """A claim of 1,000,000 in a pair is the upper median: the round fails, and the member that claimed a swarm
    more than twice the size ours shows is named (the learner bans it: learner/round.py, core/exclusion.py)."""
    averager = OuterGradientAverager.__new__(OuterGradientAverager)
    averager._base_quorum, averager._established_after, averager._running_groups = 2, 0, {}
    averager.dht, averager._standing = SimpleNamespace(peer_id="h1"), {}
    pair = SimpleNamespace(peer_ids=["h1", "liar"], group_id=b"g")
    with pytest.raises(RefusedPeers, match="below the quorum of a majority = 1000000, claimed by liar") as e:
        averager._check_quorum(Verdict(), pair, {"h1": {"quorum": 2}, "liar": {"quorum": 10**6}})
    assert e.value.peers == ("liar",) and "twice ours" in e.value.why
    assert pickle.loads(pickle.dumps(e.value)).why == e.value.why  # it crosses to the learner process
    # An honest difference (a learner or two more in its reads) fails the pair without naming anyone.
    with pytest.raises(AllreduceException) as e:
        averager._check_quorum(Verdict(), pair, {"h1": {"quorum": 2}, "liar": {"quorum": 3}})
    assert not isinstance(e.value, RefusedPeers)


def test_inflated_claims_are_those_above_twice_ours_plus_two():
    gathered = {"me": {"quorum": 3}, "a": {"quorum": 8}, "b": {"quorum": 9}, "c": {"quorum": "9"}, "d": "junk"}
    assert inflated_claims(gathered, "me") == ["b"]
    assert inflated_claims({"me": {}, "b": {"quorum": 9}}, "me") == []  # we claim nothing: no yardstick
