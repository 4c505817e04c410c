"""The averager's quorum check counts established contributions (p2p_diloco/core/standing.py)."""

from types import SimpleNamespace

import pytest
from hivemind.averaging.allreduce import AllreduceException

from p2p_diloco.core.exclusion import Verdict
from p2p_diloco.net.averager_process import OuterGradientAverager


def test_a_group_needs_the_quorum_in_established_contributions():
    """The averager's check before any part is sent: a group of two established learners and four fresh keys
    has 6 members but 2 established contributions, below a quorum of 3; with 3 established it runs."""
    averager = OuterGradientAverager.__new__(OuterGradientAverager)  # the check alone: no process, no DHT
    averager._base_quorum, averager._established_after, averager._running_groups = 2, 4, {}
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
