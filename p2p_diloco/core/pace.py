"""The round period and the overlap τ from measurements (``sync.pace = "auto"``): one configuration for every link.

On the clock schedule every learner opens fragment f's rounds at the same wall-clock slots, ``k·T + f·T/P``.
A fixed period T is right for one link only: too short and a fragment's round is still in flight at the
next fragment's slot (the slot is skipped, the fragment later downloaded); too long and a fast link idles.
With ``sync.pace = "auto"`` each learner measures, and the swarm agrees on T through its progress records
(docs/design.md, "Pace from measurements"):

    proposal_i = max(floor, H · t_step_i, SAFETY · P · t_round_i)      SAFETY = 1.5; none before a round is measured
    T          = the smallest rung floor · √2^k at or above the upper median of the training learners' proposals,
                 kept while that median stays above half of it (hysteresis), changed at the next multiple of
                 the larger period that is at least ``lead`` seconds away; a change decided but not yet in
                 use is only ever revised upwards (or cancelled, when the period in use is needed again)
    τ_i        = clamp(ceil(OVERLAP · t_round_i / t_step_i), 1, T / (P · t_step_i) − 1)

t_step_i is an exponential moving average of learner i's own inner steps; t_round_i the upper median of its last
:data:`ROUNDS_KEPT` rounds that formed a group (matchmaking, all-reduce and certificate), so that one slow round
does not move the period up a rung that the hysteresis then keeps; a slot skipped because a round was still in
flight counts that round at once, as long as it had run (:meth:`Pace.observe_overrun`). A learner with a fall
pending takes the smallest fall another learner announced from the same period (reads on both sides of a rung); a
rise pending is revised upwards only when that applies no later, and gives way to a smaller rise announced to
apply sooner. The floor is what the configuration needs (a slot per fragment longer than twice the matchmaking
time). Every learner reads nearly the same records and computes the same T from them, and a change takes effect at
a time that depends only on the two periods, so slots stay aligned; a learner whose read differs is misaligned
until its next read.
A minority of lying records cannot move the upper median outside the honest proposals' range, and a
proposal is bounded by :data:`MAX_PERIOD`.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SAFETY = 1.5  # a fragment's slot (T / P) lasts this many expected rounds: rounds do not pile up
OVERLAP = 1.25  # τ covers this many expected rounds of inner steps
RUNG = math.sqrt(2)  # periods are floor · RUNG^k: learners whose proposals differ a little agree on one rung
DOWN = 0.5  # the period goes down only once the median proposal is below this fraction of it
MAX_PERIOD = 3600.0  # the longest period (a proposal above it is clamped)
SMOOTHING = 0.3  # weight of the newest inner step in its moving average
ROUNDS_KEPT = 5  # t_round is the upper median of this many latest rounds
MIN_NOTICE = 1.0  # seconds: a change another learner announced is taken only if it is at least this far away


def rung(seconds: float, floor: float) -> float:
    """The smallest period ``floor · RUNG^k`` (k ≥ 0) at or above ``seconds``, at most :data:`MAX_PERIOD`."""
    if seconds <= floor:
        return floor
    k = math.ceil(math.log(seconds / floor, RUNG) - 1e-9)
    return min(MAX_PERIOD, round(floor * RUNG**k, 3))  # rounded: a period every learner writes the same


def is_rung(seconds: float, floor: float) -> bool:
    """Whether ``seconds`` is a period :func:`rung` gives (``floor · RUNG^k`` as rounded there, or the longest).

    >>> is_rung(56.569, 10.0), is_rung(56.5, 10.0), is_rung(10.0, 10.0), is_rung(7.071, 10.0)
    (True, False, True, False)
    """
    if not math.isfinite(seconds) or seconds < floor:
        return False
    k = round(math.log(seconds / floor, RUNG))
    return seconds == MAX_PERIOD or abs(round(floor * RUNG**k, 3) - seconds) < 1e-6


def agreed_period(proposals: Iterable[float], current: float, floor: float) -> float:
    """The swarm's period from its learners' proposals (0 or less: none yet), given the ``current`` one."""
    valid = [min(p, MAX_PERIOD) for p in proposals if math.isfinite(p) and p > 0]
    if not valid:
        return current
    median = statistics.median_high(valid)
    if current >= median > DOWN * current:
        return current  # hysteresis: a proposal a little below the period does not move it
    return rung(median, floor)


def switch_time(old: float, new: float, now: float, lead: float) -> float:
    """When a change of period takes effect: the first multiple of the larger period at least ``lead`` s after
    ``now`` (DHT time), the same for every learner that decides the same change within that lead."""
    step = max(old, new)
    return math.ceil((now + lead) / step) * step


def _on_boundary(at: float, step: float) -> bool:
    """Whether DHT time ``at`` is a multiple of ``step`` (where a change of period with that larger period applies)."""
    return abs(at / step - round(at / step)) < 1e-6


@dataclass
class Pace:
    """One learner's measurements, its proposal and the period and τ it uses; thread-safe (the heartbeat
    thread updates the period from the records, the training thread reads it and observes steps and rounds)."""

    period: float  # T in use now (sync.period_seconds until the swarm agrees on one)
    floor: float
    fragments: int
    steps_per_outer: int
    lead: float  # seconds between deciding a change of period and its effect (the records' refresh interval)
    max_overlap: int | None = None  # τ at most this (None: only the slot's length bounds it)
    t_step: float | None = None
    t_round: float | None = None
    pending: tuple[float, float] | None = None  # (period, DHT time from which it applies)
    _rounds: deque[float] = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

    def observe_step(self, seconds: float) -> None:
        with self._lock:
            self.t_step = self._ema(self.t_step, seconds)

    def observe_round(self, seconds: float, group_size: int) -> None:
        """A finished round: counted only when a group formed (a round that found none measures the timeout).

        t_round is the upper median of the latest rounds, not a moving average: with a moving average (weight 0.3)
        one round twice as long as the others raises a learner's proposal by 30 %, which can take the period a rung
        up, and the hysteresis keeps a rung until the proposals fall below half of it (WAN benchmark:
        a first round of 23 s under start-up load took the period to 80 s on a 10 Mbit/s link, where it stayed
        until the proposals came below 40 s).
        The upper median moves only when most of the latest rounds do, and errs long while there are few."""
        if group_size >= 2 and math.isfinite(seconds) and seconds >= 0:
            self._count_round(seconds)

    def observe_overrun(self, seconds: float) -> None:
        """A round still running ``seconds`` after it started made this learner skip a slot: a round at least that
        long, counted now as one of the latest rounds (and again, in full, when it ends).

        The period follows a slower link only through rounds that were slow; counted when they end, and only
        those that formed a group, three of a learner's latest five had to end slow before its proposal moved.
        After a drop from 10 to 2 Mbit/s at 150 s the period stayed at 20 s until the run reached its target at
        276 s, with 18 slots skipped and 6 of 60 rounds without a group (WAN benchmark). A skipped
        slot says at once that rounds outlast their slots; a round longer than its slot is not one a fast link
        has, so this does not lift the period on a fast link."""
        if math.isfinite(seconds) and seconds > 0:
            self._count_round(seconds)

    def _count_round(self, seconds: float) -> None:
        """One of the latest rounds took ``seconds``: t_round is their upper median."""
        with self._lock:
            self._rounds.append(seconds)
            self.t_round = statistics.median_high(self._rounds)

    def proposal(self) -> float:
        """This learner's proposed period; 0.0 (none) until it has measured an inner step and a round that formed
        a group. Proposing H · t_step before any round was measured took the period from the starting 60 s down to
        20 s on 1 and 2 Mbit/s links, where rounds took 16-35 s: slots were skipped in the first minute and one
        fragment ran two versions ahead of the other for the rest of the run (WAN benchmark)."""
        with self._lock:
            if self.t_step is None or self.t_round is None:
                return 0.0
            need = max(self.floor, self.steps_per_outer * self.t_step,
                       SAFETY * self.fragments * self.t_round)
            return min(MAX_PERIOD, need)

    def overlap(self) -> int:
        """τ for the next round: enough inner steps to cover an expected round, within the fragment's slot."""
        with self._lock:
            t_step, t_round, period = self.t_step, self.t_round, self.period
        if not t_step or t_round is None:
            tau = max(1, self.steps_per_outer // (2 * self.fragments))  # no round measured yet: half a slot
        else:
            tau = math.ceil(OVERLAP * t_round / t_step)
        slot_steps = int(period / (self.fragments * t_step)) if t_step else self.steps_per_outer // self.fragments
        tau = min(tau, max(1, slot_steps - 1))
        if self.max_overlap is not None:
            tau = min(tau, self.max_overlap)
        return max(1, tau)

    def update(self, proposals: Iterable[float], now: float,
               announced: Iterable[tuple[float, float]] = ()) -> tuple[float, float] | None:
        """Agree on the period with the records just read (``now``: DHT time); returns ``(period, at)`` when a
        change is decided or moved earlier (it applies from ``at``; :meth:`due_change` hands it to the schedule).

        ``announced``: the changes other learners' records say they decided, ``(period, at)``. Learners that decide
        the same change a few seconds apart can fall on both sides of the time that fixes its boundary, and would
        switch one period apart (seen once in the WAN benchmark): a learner with a change pending takes
        the earliest time announced for the same change, provided it is a boundary that change could have (a
        multiple of the larger period) and at least :data:`MIN_NOTICE` s away. A liar can only move it to such a
        boundary, where an honest learner's decision could have put it.
        """
        with self._lock:
            new = agreed_period(proposals, self.period, self.floor)
            decided = False
            if self.pending is None:
                if new != self.period:
                    self.pending, decided = (new, switch_time(self.period, new, now, self.lead)), True
            elif new > self.pending[0]:  # more time than the pending change gives: up at once, or cancel a cut
                if new == self.period:
                    self.pending = None
                    return None
                at = switch_time(self.period, new, now, self.lead)
                if self.pending[0] < self.period or at <= self.pending[1]:
                    self.pending, decided = (new, at), True
                # Else a rise pending applies sooner than this larger one would: it stands, and the rest of the way
                # up is decided once it is in use. (At 1 Mbit/s a rise to 113.1 s due in 55 s, revised to 160 s at
                # the next multiple of 160 s, came 158 s later: 4 rounds found no group meanwhile.)
            # Otherwise a pending change stands until it applies: revised only upwards. (Revising it at every read,
            # proposals measured under start-up load moved it 40 → 20 → 28.3 → 40 s within a minute, each time
            # with another switch time; WAN benchmark at 20 Mbit/s.)
            if self.pending is None:
                return None
            announced = list(announced)
            if self.pending[0] < self.period:
                # A fall: to the smallest fall another learner announced, at a boundary it could have (its
                # fall from the same period). Learners whose reads put the median on both sides of a rung
                # decided falls to two periods, and their slots parted (60 → 20 and 28.3 at 50 Mbit/s, WAN
                # benchmark). Only a fall an honest learner could decide counts: to a rung, and at
                # least a rung (below DOWN · period, rounded up). A liar can make a fall smaller, within that.
                smaller = [(p, a) for p, a in announced if self.pending[0] < p <= RUNG * DOWN * self.period + 1e-6
                           and is_rung(p, self.floor) and now + MIN_NOTICE <= a and _on_boundary(a, self.period)]
                if smaller:
                    period = max(p for p, _ in smaller)
                    self.pending = (period, min(a for p, a in smaller if p == period))
                    decided = True
            elif self.pending[0] > self.period:
                # A rise: to one another learner announced that applies sooner, smaller but a rung up all the same
                # (a multiple of its own period, as a rise is), so that learners whose first reads came a heartbeat
                # apart do not rise to two periods (one at once, one directly to the larger). A liar can make a
                # rise come sooner and smaller (the rest follows), never cause one.
                sooner = [(p, a) for p, a in announced if self.period < p < self.pending[0] and is_rung(p, self.floor)
                          and now + MIN_NOTICE <= a < self.pending[1] and _on_boundary(a, p)]
                if sooner:
                    at = min(a for _, a in sooner)
                    self.pending, decided = (max(p for p, a in sooner if a == at), at), True
            period, at = self.pending
            step = max(self.period, period)
            earlier = [a for p, a in announced if p == period and now + MIN_NOTICE <= a < at and _on_boundary(a, step)]
            if earlier:
                self.pending = (period, min(earlier))
                return self.pending
            return self.pending if decided else None

    def due_change(self, now: float) -> tuple[float, float] | None:
        """The decided change of period, once ``now`` (DHT time) has reached its time; it is then in use."""
        with self._lock:
            if self.pending is None or now < self.pending[1]:
                return None
            change, self.pending = self.pending, None
            self.period = change[0]
            return change
