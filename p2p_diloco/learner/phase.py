"""Keeping in phase with the swarm's rounds on the steps schedule (``sync.schedule = "steps"``).

On the steps schedule a fragment is due when this learner's inner step, moved by :attr:`Phase.shift`,
reaches the fragment's offset. One asymmetric round can put two learners' step counters a whole
search apart for good (docs/design.md, "Re-phasing on the steps schedule"), so a learner out of phase
looks in the DHT for a round the others are forming and moves its schedule into it. On the clock
schedule everyone's slot is the same and nothing here applies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from p2p_diloco.config import LearnerConfig
from p2p_diloco.core.averaging_api import Averaging
from p2p_diloco.core.fragments import Fragment
from p2p_diloco.learner.state import LearnerState

logger = logging.getLogger(__name__)

MAX_WAITS = 2  # late slots in a row at which a learner waits for the swarm's next round (Phase.wait_for_the_swarm)


@dataclass
class Phase:
    """This learner's phase against the swarm's rounds."""

    cfg: LearnerConfig
    state: LearnerState
    averaging: Averaging
    # Added to the step counter to find due fragments; moved when we re-join the swarm's rounds.
    shift: int = 0
    # No phase with the swarm yet (no round of ours committed since we started), or the last round on the
    # steps schedule ended without a commit: :meth:`look` looks for the swarm's round.
    out: bool = True
    next_look: float = 0.0  # monotonic time of the next DHT look for the others' rounds
    waits: int = 0  # slots in a row at which we were late for the swarm's round and waited for its next

    def steps(self) -> int:
        """The step counter the schedule reads: ours, moved by :attr:`shift`."""
        return self.state.counters.inner_steps + self.shift

    def committed(self) -> None:
        """A round of ours committed: we are in the swarm's phase."""
        self.out, self.waits = False, 0

    def failed(self) -> None:
        """A round of ours ended without a commit: look for the swarm's rounds again."""
        self.out = True

    def look(self, candidates: Iterable[Fragment], skip: Callable[[int], bool]) -> Fragment | None:
        """While out of phase (at most once per matchmaking time): the first of ``candidates`` (fragments we
        hold steps of and ``skip`` does not rule out) whose round peers are forming now at our version, with
        :attr:`shift` moved so that it is due now; None if there is none, or the DHT look failed.

        Only the learner whose round failed moves, into a search already under way: nobody waits longer than
        one search. A learner that has just started (or restarted) has no phase yet: it joins the swarm's round
        in the same way, with the steps it has (at least one), instead of reaching its own slot after the
        swarm's group has formed.
        """
        now = time.monotonic()
        if not self.out or now < self.next_look:
            return None
        self.next_look = now + self.cfg.averaging.matchmaking_time
        h, c = self.cfg.inner.steps_per_outer, self.state.counters
        for frag in candidates:
            if skip(frag.index) or not c.steps_since_merge[frag.index]:
                continue
            others = self.searching(frag.index)
            if others is None:
                return None  # a failed DHT look is a missed chance, not an error
            if others:
                shift = (frag.offset - c.inner_steps) % h
                logger.info(f"out of phase with the swarm: joining the round of fragment {frag.index} that "
                            f"{others} other learner(s) are forming (schedule moved by {shift} of {h} steps)")
                self.shift = shift
                return frag
        return None

    def searching(self, f: int) -> int | None:
        """How many other peers look for a group of fragment ``f`` at our version (DHT); None if the look failed."""
        try:
            return self.averaging.searching_peers(f, self.state.states[f].version)
        except Exception as e:  # noqa: BLE001 - a peer's DHT hiccup is the caller's missed chance, not an error
            logger.debug(f"could not look for the others' rounds: {type(e).__name__}: {e}")
            return None

    def wait_for_the_swarm(self, f: int) -> bool:
        """The swarm committed fragment ``f`` without us (we were late for its round) and we took its state:
        whether our steps wait for the swarm's next round instead of a round of ours at the new version now.

        Every learner late for the same round starting one at once committed the next version among
        themselves, half a period after the others, who were then late in turn: 8 learners split into
        two halves whose rounds took turns for the whole run (docs/scale.md). So the late learner now
        waits: :meth:`look` looks for the swarm's next round (now, then once per matchmaking time) and
        moves our schedule into it. After ``MAX_WAITS`` slots in a row without a commit it rounds at once
        again.
        """
        if self.waits >= MAX_WAITS:
            return False
        self.waits += 1
        logger.info(f"fragment {f}: the swarm committed version {self.state.states[f].version} without us; our steps "
                    "wait for its next round")
        self.out, self.next_look = True, 0.0
        return True
