"""A leader closes its group as soon as everyone training has joined, instead of at the end of its window.

hivemind's leader starts the all-reduce when its group is full (``target_group_size``, the largest group it
accepts) or when its matchmaking window ends. A swarm smaller than the target never fills a group, so every
round waited its whole window although the last learner that could come had come: in the README's demo
(3 learners, a 3 s window, no overlap) a round took 3.4-3.8 s while its all-reduce took 0.2 s, and the
learners computed 30-34% of the time; with this rule 0.8-1.6 s and 53-59%
(benchmarks/results/round_latency_2026-12-07_07591cf.md).

:class:`EarlyClose` keeps hivemind's target and window and adds one more reason to start: the group holds every
learner the swarm's records show training (this learner included; the learner sends their peer IDs before
every round with its quorum, ``averager_process.set_min_group_size``), and every peer declared in the DHT as
searching under the round's key (a read that shows this leader's own declaration) is among them. The records
lag a learner that has just started (a first try of this rule, which counted on the records alone and also
capped the group at their count, left such a learner out of its own rounds): one that already searches is
waited for; one that has not reached its round yet misses it and meets the next, as one that arrives after a
window does. For the same reason a learner's first ``network.record_ttl`` seconds use the window alone
(``HivemindAveraging.early_close_after``): learners started a few seconds apart do not see each other's
records yet (CI of 8cbc5b5: two learners closed their first rounds as a pair while the third, started 5 s
later, was declaring itself, and it took part in 5 fragment rounds instead of 8). A learner the records
show but that does not come (banned here, out of phase, cut off) costs the whole window, as before. The
majority quorum is unchanged: a group that closes early holds everyone this learner sees, more than the
majority it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

logger = get_logger(__name__)


class EarlyClose(Matchmaking):
    """hivemind's :class:`Matchmaking`, whose leader also starts once every peer of ``expected`` (the learners the
    records show training, as peer ID strings) and every peer searching under the round's key is in its group.
    ``expected`` empty: hivemind's rule alone."""

    expected: frozenset[str] = frozenset()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._closing: set[asyncio.Task] = set()  # the close checks in flight, held so that the loop keeps them

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        # hivemind's handler, whose ``finally`` (the follower leaves current_followers) must run when ours ends
        async with contextlib.aclosing(super().rpc_join_group(request, context)) as replies:
            async for reply in replies:
                if reply.code == averaging_pb2.ACCEPTED and self.expected:
                    # hivemind holds lock_request_join_group until this reply is sent: close after it
                    task = asyncio.create_task(self._close_if_everyone_joined())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
                yield reply

    async def _close_if_everyone_joined(self) -> None:
        if not self.everyone_joined():
            return
        # The records lag a learner that has just started: one searching at this round's key is waited for too.
        key = self.group_key_manager.current_key
        try:
            searching = [peer for peer, _ in await self.group_key_manager.get_averagers(key, only_active=True)]
        except Exception as e:  # the DHT is the peers' input and may fail: the window decides, as hivemind has it
            logger.debug(f"early close: reading who searches at {key} failed: {e!r}")
            return
        async with self.lock_request_join_group:
            if (key == self.group_key_manager.current_key and self.everyone_joined()
                    and self.holds_every_searcher(searching)):
                try:
                    await self.leader_assemble_group()
                except Exception as e:  # hivemind's own paths assemble again at the window's end, and fail there
                    logger.warning(f"early close: assembling the group failed: {e!r}")

    def holds_every_searcher(self, searching: Iterable[PeerID]) -> bool:
        """Whether the read of the round's key is whole enough to trust (it shows this leader's own declaration)
        and every peer it shows searching is this leader or in its group."""
        searching = list(searching)
        return self.peer_id in searching and all(
            peer == self.peer_id or peer in self.current_followers for peer in searching)

    def everyone_joined(self) -> bool:
        """Whether this leader, still gathering, holds every expected learner and at least its quorum."""
        members = {str(peer) for peer in self.current_followers} | {str(self.peer_id)}
        return (bool(self.expected) and self.expected <= members and len(members) >= self.min_group_size
                and self.is_looking_for_group and not self.client_mode and self.current_leader is None
                and not self.assembled_group.done())
