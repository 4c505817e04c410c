"""Leaving: the stop signals and their budget, the parting rounds that hand unmerged inner steps to
the swarm before going, and lingering to serve the final state to learners still behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from hivemind.utils import get_dht_time

from p2p_diloco.core.fragments import Fragment
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.catch_up import CatchUp
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.schedule import Rounds

logger = logging.getLogger(__name__)


class Leaving:
    """Ctrl+C / SIGTERM: the first signal sets ``stop``, a second ``leave_now``.

    After ``stop``, rounds and downloads may go on for ``drain_seconds`` from the first look (the
    parting budget): a round already forming when the signal lands is the parting round the others
    are meeting in. A stop before training began (set-up, first download) leaves at once.
    """

    def __init__(self, drain_seconds: float, stop: threading.Event | None = None):
        self.drain_seconds = drain_seconds
        self.stop = stop or threading.Event()
        self.leave_now = threading.Event()
        self.training = False
        self.until: float | None = None  # when the parting budget ends (monotonic), set at the first look

    def __call__(self) -> bool:
        """Whether matchmaking and downloads should give up now."""
        if self.leave_now.is_set():
            return True
        if not self.stop.is_set():
            return False
        if self.until is None:
            self.until = time.monotonic() + (self.drain_seconds if self.training else 0.0)
        return time.monotonic() > self.until

    def end_budget(self) -> None:
        """The parting rounds are over: anything still forming gives up now."""
        self.until = 0.0


def _open(rounds: Rounds, frag: Fragment) -> bool:
    return rounds.state.counters.steps_since_merge[frag.index] > 0 and not rounds.at_target(frag.index)


def hand_over(leaving: Leaving, rounds: Rounds, catch_up: CatchUp, progress: Progress) -> None:
    """Leaving on Ctrl+C or SIGTERM: hand the unmerged inner steps to the swarm before going.

    Each fragment holding steps not yet merged joins one more round, in the foreground: at its
    next slot on the clock schedule (where the others will be), at once and again until a group
    forms on the steps schedule, all within ``run.drain_seconds`` of the signal (an all-reduce
    under way at the deadline finishes first). A second signal cuts it short. The checkpoint was
    written just before, and each commit writes another, so a kill meanwhile loses nothing. The
    steps stay in the checkpoint for a ``--resume`` when there is no live peer to hand them to, or
    while a late round still occupies the averager (it may hold them).
    """
    todo = [frag for frag in rounds.state.fragments if _open(rounds, frag)]
    if leaving.drain_seconds <= 0 or not todo or leaving.leave_now.is_set():
        return
    why_not = _why_not_hand_over(leaving, rounds, progress)
    if why_not:
        logger.info(f"leaving: {why_not}; the unmerged steps stay in the checkpoint")
        return
    assert leaving.until is not None  # set by leaving() above
    deadline, clock = leaving.until, rounds.clock
    logger.info(f"leaving: handing {max(rounds.state.counters.steps_since_merge):.0f} unmerged inner steps to the "
                f"swarm in a last round of {len(todo)} fragment(s), for at most {deadline - time.monotonic():.0f} s "
                "more (signal again to leave now)")
    if clock is not None:
        todo.sort(key=lambda frag: clock.next_slot(frag, get_dht_time()))
    try:
        for frag in todo:
            _parting_round(leaving, rounds, catch_up, frag, deadline)
    except LearnerError as e:  # the swarm has finished meanwhile
        logger.warning(f"leaving: {e}")
        return
    left = sum(1 for frag in todo if _open(rounds, frag))
    logger.info("leaving: " + (f"{left} fragment(s) not merged; their steps stay in the checkpoint" if left
                               else "every fragment's steps merged"))


def _why_not_hand_over(leaving: Leaving, rounds: Rounds, progress: Progress) -> str:
    if leaving():
        return "no time left for a parting round (run.drain_seconds)"  # the round forming at the signal used it
    if rounds.detached is not None:
        # The averager is still busy with it (until its all-reduce timeout); a round now would
        # queue behind it, past the budget, and might send the steps that round holds again.
        return "a late round is still running"
    if not any(r.status == "training" for r in progress.others(fresh=True).values()):
        return "no peer is training"
    return ""


def _parting_round(leaving: Leaving, rounds: Rounds, catch_up: CatchUp, frag: Fragment, deadline: float) -> None:
    """Rounds of ``frag`` until one commits, the budget runs out or a second signal comes."""
    cfg, clock = rounds.cfg, rounds.clock
    while not leaving.leave_now.is_set() and _open(rounds, frag):
        wait = 0.0 if clock is None else clock.next_slot(frag, get_dht_time()) - get_dht_time()
        if time.monotonic() + wait + cfg.averaging.matchmaking_time > deadline:
            return
        if leaving.leave_now.wait(wait):
            return
        if deadline - time.monotonic() > cfg.averaging.next_chunk_timeout:  # room for a download
            catch_up.start()
        if not _open(rounds, frag):
            return
        rounds.start(frag, background=False)
        if rounds.last_outcome is not None and rounds.last_outcome.committed:
            return
        if clock is None and leaving.leave_now.wait(1.0):  # a round that failed at once: no busy loop
            return


def linger(leaving: Leaving, progress: Progress, versions: Sequence[int], seconds: float) -> None:
    """Serve the final state while learners still training are behind us on any fragment (``versions``: ours, one
    per fragment; bounded by ``seconds``).

    Behind as the records remembered show them (:meth:`Progress.recently_training`), not as one read does: while
    downloads fill a slow link, reads miss the records of the very learners downloading from us, and a learner that
    left while they were behind let them commit versions of their own under numbers the swarm had used (a fork;
    WAN benchmark, links 10 → 2 Mbit/s). Behind on any fragment, not by the oldest one: a learner at
    versions [8, 8] is behind us at [8, 9], and one that was downloading fragment 1 from the last learners to leave
    was left alone with a stream cut mid-tensor, unable to commit or catch up (WAN benchmark, 10 Mbit/s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not leaving.stop.is_set():
        progress.records(fresh=True)
        behind = [p for p, r in progress.recently_training().items()
                  if p != progress.state.peer_id and any(r.fragment_version(f) < v for f, v in enumerate(versions))]
        if not behind:
            return
        leaving.stop.wait(1.0)
