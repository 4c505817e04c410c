"""When a leader may start before its window ends (p2p_diloco/net/early_close.py): only with everyone counted
in its group, at least its quorum, while it still gathers as a leader."""

import asyncio

import pytest
from hivemind.averaging.matchmaking import Matchmaking

from p2p_diloco.net.patient_matchmaking import PatientMatchmaking


def _leader(followers: int, close_at: int, min_group_size: int = 2) -> PatientMatchmaking:
    """A Matchmaking with only what the check reads (hivemind's own needs a running p2p daemon), gathering."""
    mm = object.__new__(Matchmaking)
    lock = asyncio.Lock()
    asyncio.run(lock.acquire())  # is_looking_for_group: hivemind holds this lock while it looks for a group
    mm.__dict__.update(request_timeout=1.0, lock_request_join_group=asyncio.Lock(), lock_looking_for_group=lock,
                       current_followers={f"peer{i}": None for i in range(followers)}, min_group_size=min_group_size,
                       client_mode=False, current_leader=None, assembled_group=asyncio.Future(loop=_LOOP),
                       peer_id="leader")
    adopted = PatientMatchmaking.adopt(mm)
    adopted.close_at = close_at
    return adopted


_LOOP = asyncio.new_event_loop()


def test_a_leader_starts_once_everyone_counted_is_in():
    assert _leader(followers=2, close_at=3).everyone_joined()
    assert _leader(followers=3, close_at=3).everyone_joined()  # one more than the records showed
    assert not _leader(followers=1, close_at=3).everyone_joined()  # one still to come


@pytest.mark.parametrize("change", ["off", "below quorum", "not looking", "has a leader", "client", "assembled"])
def test_no_early_start_otherwise(change):
    mm = _leader(followers=2, close_at=3)
    if change == "off":
        mm.close_at = 0  # hivemind's rule alone
    elif change == "below quorum":
        mm.min_group_size = 4  # everyone counted is fewer than the quorum: the window decides, as before
    elif change == "not looking":
        mm.lock_looking_for_group.release()
    elif change == "has a leader":
        mm.current_leader = "another"  # it is joining another's group
    elif change == "client":
        mm.client_mode = True  # a client never leads
    else:
        mm.assembled_group.set_result("group")
    assert not mm.everyone_joined()


def test_a_peer_searching_at_the_rounds_key_is_waited_for():
    """The records lag a learner that has just started; its declaration under the round's key does not."""
    mm = _leader(followers=2, close_at=3)
    assert mm.holds_every_searcher(["leader", "peer0", "peer1"])
    assert mm.holds_every_searcher([])  # nobody declared (yet): the count decides
    assert not mm.holds_every_searcher(["leader", "peer0", "newcomer"])
