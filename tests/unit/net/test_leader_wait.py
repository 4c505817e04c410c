"""The wait for a leader's go follows the measured all-reduces; the wait for its answer stays hivemind's."""

import asyncio

from hivemind.averaging.matchmaking import Matchmaking

from p2p_diloco.net.averaging import go_timeout
from p2p_diloco.net.patient_matchmaking import PatientMatchmaking


def _matchmaking(request_timeout: float) -> Matchmaking:
    """A Matchmaking with only what the waits read (hivemind's own needs a running p2p daemon)."""
    mm = object.__new__(Matchmaking)
    mm.__dict__.update(request_timeout=request_timeout, lock_request_join_group=asyncio.Lock())
    return mm


def test_the_go_waits_longer_and_the_answer_as_configured():
    mm = PatientMatchmaking.adopt(_matchmaking(1.0))
    assert PatientMatchmaking.adopt(mm) is mm and mm.request_timeout == 1.0  # adopting twice changes nothing
    mm.go_timeout = 6.0
    assert mm.request_timeout == 6.0  # the wait for the go: outside the lock

    async def answering() -> float:
        async with mm.lock_request_join_group:  # hivemind holds it while it waits for a leader's answer
            return mm.request_timeout

    assert asyncio.run(answering()) == 1.0  # hivemind's deadlock breaker stays short
    mm.go_timeout = 0.5
    assert mm.request_timeout == 1.0  # never shorter than configured
    mm.request_timeout = 2.0  # hivemind's own assignment still sets the answer's wait
    assert mm.request_timeout == 2.0 and mm.__dict__["answer_timeout"] == 2.0


def test_the_go_timeout_is_a_share_of_the_recent_all_reduces():
    assert go_timeout(1.0, [], 30.0) == 1.0  # nothing measured: as configured
    assert go_timeout(1.0, [0.3, 0.4, 3.0], 30.0) == 1.0  # a fast link
    assert go_timeout(1.0, [16.0, 40.0, 24.0, 20.0], 30.0) == 6.0  # 1 Mbit/s: a quarter of the upper median
    assert go_timeout(2.0, [500.0], 30.0) == 15.0  # at most half the round timeout
