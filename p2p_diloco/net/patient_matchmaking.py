"""How long a member waits for its leader: hivemind's one ``request_timeout``, split in two.

hivemind's follower waits ``request_timeout`` for a leader's answer to its request, holding its
``lock_request_join_group``: two averagers that request each other at once deadlock until that wait
ends, so hivemind asks for a wait shorter than the matchmaking time. Once accepted, the follower waits
for the leader's go (the group's member list and gathered metadata) until the group's deadline plus the
same ``request_timeout``, without the lock. On a slow link the go, a few hundred bytes, queues behind
the data of a round still in flight: at 1 Mbit/s a member gave up on it after the WAN benchmark's 1 s
while its leader had counted it in, and the group's all-reduce failed ("never received the leader's
go"; 3 of 33 rounds, WAN benchmark).

:class:`PatientMatchmaking` keeps the wait for an answer as configured and lets the wait for the go be
longer (``go_timeout``: the learner sets it from its measured all-reduces, hivemind_averaging.py). It
changes no hivemind code path: ``request_timeout`` is read where hivemind reads it, and is the longer
wait only while this averager does not hold ``lock_request_join_group``.
"""

from __future__ import annotations

from hivemind.averaging.matchmaking import Matchmaking

from p2p_diloco.net.early_close import EarlyClose


class PatientMatchmaking(EarlyClose):
    """hivemind's :class:`Matchmaking` (with :class:`EarlyClose`'s leader), waiting up to ``go_timeout`` for a
    leader's go (when that is longer than ``request_timeout``) and ``request_timeout`` for a leader's answer."""

    go_timeout: float = 0.0

    @property
    def request_timeout(self) -> float:
        """The answer's wait while the lock is held (hivemind's deadlock breaker), the go's wait otherwise. A
        handler of another peer's request that holds the lock at the moment the go's wait starts gives the
        shorter wait, hivemind's own."""
        answer = self.__dict__["answer_timeout"]
        return answer if self.lock_request_join_group.locked() else max(answer, self.go_timeout)

    @request_timeout.setter
    def request_timeout(self, seconds: float) -> None:
        self.__dict__["answer_timeout"] = seconds

    @classmethod
    def adopt(cls, matchmaking: Matchmaking) -> PatientMatchmaking:
        """``matchmaking`` (built by hivemind in the averager process) as a :class:`PatientMatchmaking`, in place."""
        if not isinstance(matchmaking, cls):
            answer = matchmaking.__dict__.pop("request_timeout")
            matchmaking.__class__ = cls
            matchmaking.request_timeout = answer
            matchmaking._closing = set()  # what EarlyClose.__init__ makes (hivemind built this one)
        assert isinstance(matchmaking, cls)
        return matchmaking
