"""This learner's short bans of peers it caught: listed to every group it joins, counted as one vote there.

A peer this learner excluded on evidence (:func:`p2p_diloco.core.exclusion.judge`, rules 1-3) or accused after a
round (a failure that was its doing: a reducer's shard that did not match what its senders sent, a withheld
sketch, a signature of another hash) is banned from this learner's next rounds; a member listed by a strict
majority of its other groupmates is left out (rule 4 of :mod:`p2p_diloco.core.exclusion`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2p_diloco.core.exclusion import MAX_BANS

if TYPE_CHECKING:
    from p2p_diloco.core.exclusion import Verdict

logger = logging.getLogger(__name__)

MAX_BAN_ROUNDS = 48  # the longest ban a repeated accusation starts (Bans.accuse)


@dataclass
class Bans:
    """This learner's short bans: a peer it excluded (rules 1-3) is listed for its next ``rounds`` rounds.

    The list is gathered to every group (:meth:`listed`); :func:`judge` counts it as one vote. A peer accused again
    after its ban (:meth:`accuse`: a failed round was its doing) is banned twice as long each time, up to
    :data:`MAX_BAN_ROUNDS`: a member that fails one round in every ``rounds + 1`` costs less each time.
    """

    rounds: int = 3
    _left: dict[str, int] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)  # accusations that started a ban, by peer

    def listed(self) -> list[str]:
        """The peers this learner bans now, as it gathers them (sorted, at most :data:`MAX_BANS`)."""
        return sorted(self._left)[:MAX_BANS]

    def accuse(self, peer: str, me: str, why: str) -> None:
        """Ban ``peer`` (not ``me``) from this learner's next rounds on evidence found after a round, not in its verdict
        (a reducer whose shard did not match what its senders sent, p2p_diloco/core/shard_sketches.py)."""
        if peer == me or self.rounds <= 0:
            return
        if peer in self._left:  # one failure may be named twice (the round's and the commit's): one strike
            self._left[peer] = max(self._left[peer], self.rounds + 1)
            return
        strikes = self._strikes.get(peer, 0)
        if len(self._strikes) >= 4 * MAX_BANS and peer not in self._strikes:
            self._strikes.pop(next(iter(self._strikes)))  # bounded: the oldest accused peer is forgotten
        self._strikes[peer] = strikes + 1
        rounds = min(self.rounds << min(strikes, 16), max(self.rounds, MAX_BAN_ROUNDS))
        logger.info(f"{peer[-6:]} is banned from this learner's next {rounds} rounds: {why}")
        self._left[peer] = rounds + 1  # the next round's after_round counts one off

    def after_round(self, verdict: Verdict | None, me: str) -> list[str]:
        """Count one round of this learner; ban the peers ``verdict`` excluded on evidence (not ``me``).

        Returns the peers newly banned; each is logged once, when its ban starts.
        """
        self._left = {p: n - 1 for p, n in self._left.items() if n > 1}
        if verdict is None or self.rounds <= 0:
            return []
        new = []
        for peer, exclusion in sorted(verdict.excluded.items()):
            if exclusion.banned or not exclusion.evidence or peer == me:
                continue
            if peer not in self._left:
                new.append(peer)
                logger.info(f"{peer[-6:]} is banned from this learner's next {self.rounds} rounds")
            self._left[peer] = self.rounds
        return new
