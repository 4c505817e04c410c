"""Who reduces a share of the fragment: from each member's own (signed) metadata, never from what the leader relays."""

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers

from p2p_diloco.net.averager_process import reducer_shares

NODE, CLIENT = AveragingMode.NODE, AveragingMode.CLIENT


def test_every_member_that_says_it_reduces_gets_an_equal_share():
    # A leader that relays the others as clients (outside the signatures) cannot take the fragment for itself.
    named = {p: {"reduces": True} for p in "abcd"}
    shares = reducer_shares(list("abcd"), [NODE, CLIENT, CLIENT, CLIENT], [False] * 4, named)
    assert shares == [None] * 4
    assert load_balance_peers(1000, shares) == (250, 250, 250, 250)


def test_clients_and_excluded_members_reduce_nothing():
    named = {"a": {"reduces": True}, "b": {"reduces": False}, "c": {"reduces": True}, "d": {"reduces": True}}
    shares = reducer_shares(list("abcd"), [NODE] * 4, [False, False, False, True], named)
    assert shares == [None, 0.0, None, 0.0]
    assert load_balance_peers(1000, shares) == (500, 0, 500, 0)


def test_metadata_without_the_flag_falls_back_to_the_gathered_mode():
    shares = reducer_shares(["a", "b", "c"], [NODE, CLIENT, NODE], [False] * 3,
                            {"a": {}, "b": {"reduces": "yes"}, "c": None})
    assert shares == [None, 0.0, None]
