"""This learner's bans (p2p_diloco/core/bans.py): how long they last, escalation, who is never banned."""

from __future__ import annotations

import logging

from p2p_diloco.core.bans import Bans
from p2p_diloco.core.exclusion import Exclusion, Verdict


def test_bans_last_the_given_number_of_rounds_and_are_logged_once(caplog):
    bans = Bans(rounds=3)
    caught = Verdict(excluded={"peer-x": Exclusion("its outer gradient is not finite")})
    with caplog.at_level(logging.INFO, logger="p2p_diloco.core.bans"):
        assert bans.after_round(caught, me="me") == ["peer-x"]
        assert bans.after_round(caught, me="me") == []  # caught again: the ban restarts, no new line
    assert [r.getMessage() for r in caplog.records] == ["peer-x is banned from this learner's next 3 rounds"]
    listed = []
    for _ in range(4):
        listed.append(bans.listed())
        bans.after_round(Verdict(), me="me")
    assert listed == [["peer-x"], ["peer-x"], ["peer-x"], []]


def test_a_peer_accused_again_is_banned_twice_as_long_each_time():
    bans = Bans(rounds=3)
    lengths = []
    for _ in range(6):
        bans.accuse("peer-x", me="me", why="no sketch from it")
        bans.accuse("peer-x", me="me", why="it signed another hash")  # the same failure named twice: one strike
        bans.after_round(Verdict(), me="me")  # the failed round itself
        n = 0
        while bans.listed():
            bans.after_round(Verdict(), me="me")
            n += 1
        lengths.append(n)
    assert lengths == [3, 6, 12, 24, 48, 48]
    bans.accuse("me", me="me", why="never ourselves")
    assert bans.listed() == []


def test_bans_skip_ourselves_and_ban_only_exclusions_and_can_be_off():
    verdict = Verdict(excluded={"a": Exclusion("its outer gradient is not finite"), "me": Exclusion("norm ..."),
                                "y": Exclusion("banned by 2 of 3 groupmates", banned=True)})
    bans = Bans(rounds=2)
    bans.after_round(verdict, me="me")
    assert bans.listed() == ["a"]  # a ban does not renew itself: it ends after its rounds
    off = Bans(rounds=0)
    off.after_round(verdict, me="me")
    assert off.listed() == []
