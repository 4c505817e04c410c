"""The end of the run as the progress records show it: who finished, whether the swarm left without us.

A learner stops at ``run.max_outer_steps`` or at ``run.stop_at_eval_loss``; the others may get there
first. :class:`SwarmEnd` keeps what this learner has seen of that, from each read of the records
(:meth:`SwarmEnd.observe`, called by :meth:`p2p_diloco.learner.catch_up.CatchUp.look`), and the learner's
loop reads it to decide whether training is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from p2p_diloco.config import LearnerConfig
from p2p_diloco.errors import LearnerError
from p2p_diloco.net.progress_records import ProgressRecord

logger = logging.getLogger(__name__)


@dataclass
class SwarmEnd:
    """What this learner has seen of the run's end."""

    cfg: LearnerConfig
    fragments: int
    done_at: list[int] = field(default_factory=list)  # per fragment: the newest version a finished peer held
    saw_finished: bool = False  # a peer's record said done (it reached the run's end)
    # stop_at_eval_loss: level with finished peers that left, nobody else training (no round can commit)
    left_alone: bool = False
    gone: bool = False  # the others reached the target and left while we were behind: stop too
    # The newest version at which a peer was done or left at (or past) the run's target (0: none seen).
    # Remembered: a peer's record saying "left" expires record_ttl after it was stored, and a learner reads the
    # records for this at its round slots. scale_swarm.py at 16 learners: one learner left out of the last round
    # read them 44 s later, while the others were done and leaving; its download failed, their records expired
    # before its next slot, and it trained alone for the benchmark's 900 s.
    finished_at: int = 0
    _nobody_since: float | None = field(default=None, repr=False)  # monotonic: since when reads show nobody live

    def __post_init__(self) -> None:
        self.done_at = self.done_at or [0] * self.fragments

    def observe(self, records: Mapping[str, ProgressRecord], live: Mapping[str, ProgressRecord],
                versions: Sequence[int], behind: bool, others_training: Callable[[], set[str]],
                now: float | None = None) -> None:
        """Note what one read of the others' ``records`` says (``live``: those that have not left; ``versions``:
        ours per fragment; ``behind``: some peer holds newer state, so the end is not ours to judge yet; ``now``:
        monotonic seconds, the clock's by default).

        Raises :class:`LearnerError` if the swarm finished the run without us and nobody serves its state: a peer
        left at the target and nobody is live in this read, or peers were seen done or gone at the target earlier
        and every read for 2 · ``network.record_ttl`` since has shown nobody live (one read can miss live peers'
        records, and a failed lookup shows nobody).
        """
        now = time.monotonic() if now is None else now
        self.left_alone = False
        target = self.cfg.run.max_outer_steps
        for r in live.values():
            if r.status == "done":
                self.saw_finished = True
                self.done_at = [max(v, r.fragment_version(f)) for f, v in enumerate(self.done_at)]
        if target:  # remembered whether or not we are behind them now
            self.finished_at = max([self.finished_at, *(r.version for r in records.values()
                                                        if r.status in ("done", "left") and r.version >= target)])
        self._nobody_since = None if live else (now if self._nobody_since is None else self._nobody_since)
        if behind:
            return
        finished = [r.version for r in records.values() if r.status == "left" and target and r.version >= target]
        gone_long = (self.finished_at > 0 and self._nobody_since is not None
                     and now - self._nobody_since >= 2 * self.cfg.network.record_ttl)
        if ((finished or gone_long) and target is not None and min(versions, default=0) < target
                and not live):
            raise LearnerError(
                f"the swarm already finished at version {self.finished_at} and no running peer serves that "
                f"state; start this learner with a higher --max-outer-steps or with other learners"
            )
        # Ahead on any fragment, not by the oldest one: at [8, 8] against finished peers' [8, 9] we are behind
        # (WAN benchmark at 10 Mbit/s: a learner so left trained alone until the benchmark's timeout).
        done_ahead = any(d > v for d, v in zip(self.done_at, versions, strict=True))
        if self.cfg.run.stop_at_eval_loss is not None and done_ahead and not live:
            # Peers stopped at the target loss ahead of us and have left while we were behind (say,
            # mid-download over a slow link): nobody is left to merge with or to serve the state, so
            # we stop too instead of training alone. Our local progress is in the checkpoint.
            self.gone = True
            logger.warning(f"the swarm reached the target at fragment versions {self.done_at} and left while we were "
                           "behind; stopping too (local progress is in the checkpoint)")
            return
        # Level with (or ahead of) finished peers that have left, and nobody else training: with a quorum above one
        # no round of ours can commit, so our global model no longer changes. The learner evaluates it once more and
        # stops (Learner._end_of_outer_step). WAN benchmark at 10 Mbit/s: a learner at the finished
        # peers' versions [5, 6], whose global model read 2.67 against the target 2.6, trained alone until stopped.
        self.left_alone = (self.cfg.run.stop_at_eval_loss is not None and self.saw_finished and not live
                           and not others_training() and self.cfg.averaging.min_group_size > 1)

    def give_up(self) -> None:
        """Alone at the end, the global model short of the target: no round can commit, so stop."""
        self.gone = True
