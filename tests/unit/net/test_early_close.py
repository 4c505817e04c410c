"""When a leader may start before its window ends (p2p_diloco/net/early_close.py): only with every learner
expected in its group, at least its quorum, while it still gathers as a leader, and only once a read of the
round's key shows nobody else searching."""

import asyncio

import pytest
from hivemind.averaging.matchmaking import Matchmaking

from p2p_diloco.net.patient_matchmaking import PatientMatchmaking

KEY = "prefix.0b01"


class _Keys:
    """The group key manager's part the close check reads: the round's key and who searches under it."""

    def __init__(self, searching, fail=False):
        self.current_key, self.searching, self.fail = KEY, searching, fail

    async def get_averagers(self, key, only_active):
        assert key == KEY and only_active
        if self.fail:
            raise TimeoutError("no reply")
        return [(peer, 0.0) for peer in self.searching]


def _leader(followers, expected, min_group_size=2, searching=(), fail=False) -> PatientMatchmaking:
    """A Matchmaking with only what the check reads (hivemind's own needs a running p2p daemon), gathering;
    assembling records the call instead of forming a group."""
    mm = object.__new__(Matchmaking)
    mm.__dict__.update(request_timeout=1.0, lock_request_join_group=asyncio.Lock(), lock_looking_for_group=None,
                       current_followers={peer: None for peer in followers}, min_group_size=min_group_size,
                       client_mode=False, current_leader=None, peer_id="leader",
                       group_key_manager=_Keys(searching, fail))
    adopted = PatientMatchmaking.adopt(mm)
    adopted.expected = frozenset(expected)
    adopted.assembled = []
    return adopted


async def _check(mm, change=None) -> list:
    """Run one close check in a loop where hivemind's locks and futures live; ``change`` alters the leader first."""
    mm.lock_looking_for_group = asyncio.Lock()
    await mm.lock_looking_for_group.acquire()  # is_looking_for_group: hivemind holds it while it searches
    mm.assembled_group = asyncio.get_running_loop().create_future()

    async def assemble():
        mm.assembled.append(sorted(mm.current_followers))

    mm.leader_assemble_group = assemble
    if change:
        change(mm)
    await mm._close_if_everyone_joined()
    return mm.assembled


EVERYONE = {"leader", "a", "b"}


def test_a_leader_starts_once_everyone_expected_and_searching_is_in():
    assert asyncio.run(_check(_leader(["a", "b"], EVERYONE, searching=["leader", "a", "b"]))) == [["a", "b"]]
    # a newcomer the records do not show yet has joined too: it is in the group
    mm = _leader(["a", "b", "new"], EVERYONE, searching=["leader", "a", "b", "new"])
    assert asyncio.run(_check(mm)) == [["a", "b", "new"]]


@pytest.mark.parametrize("case", ["one expected still to come", "as many members but another one", "off",
                                  "below quorum", "a newcomer searching", "a read without us", "a read failing",
                                  "not looking", "has a leader", "client", "assembled", "the key moved on"])
def test_no_early_start_otherwise(case):
    followers, expected, searching = ["a", "b"], set(EVERYONE), ["leader", "a", "b"]
    kwargs: dict = {}
    change = None
    if case == "one expected still to come":
        followers = ["a"]
    elif case == "as many members but another one":
        followers = ["a", "stranger"]  # three members, but b is expected and not in
    elif case == "off":
        expected = set()  # hivemind's rule alone
    elif case == "below quorum":
        kwargs["min_group_size"] = 4  # everyone expected is fewer than the quorum: the window decides, as before
    elif case == "a newcomer searching":
        searching = [*searching, "new"]  # the records lag it; its declaration does not
    elif case == "a read without us":
        searching = []  # a read that misses our own declaration may miss others': not trusted
    elif case == "a read failing":
        kwargs["fail"] = True
    elif case == "not looking":
        def change(mm):
            mm.lock_looking_for_group.release()
    elif case == "has a leader":
        def change(mm):
            mm.current_leader = "another"  # it is joining another's group
    elif case == "client":
        def change(mm):
            mm.client_mode = True  # a client never leads
    elif case == "assembled":
        def change(mm):
            mm.assembled_group.set_result("group")
    else:
        class _Moving(_Keys):
            async def get_averagers(self, key, only_active):
                found = await super().get_averagers(key, only_active)
                self.current_key = "prefix.0b10"  # a new search began while the read was in flight
                return found

        def change(mm):
            mm.group_key_manager = _Moving(searching)
    mm = _leader(followers, expected, searching=searching, **kwargs)
    assert asyncio.run(_check(mm, change)) == []
