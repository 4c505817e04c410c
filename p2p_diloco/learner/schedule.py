"""Fragment rounds on the learner's side: which fragments are due, starting a round (in the
background while inner steps go on, or here), applying its result under ``sync.apply_policy`` when
it is due, training on without a round that outlives its budget, and re-joining the swarm's phase.

One outer round itself (Δ, all-reduce, checks, outer step) is :class:`~p2p_diloco.learner.round.OuterRound`;
the schedules are in :mod:`p2p_diloco.core.fragments`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.config import LearnerConfig
from p2p_diloco.core.averaging_api import Averaging
from p2p_diloco.core.fragments import ClockSchedule, Fragment, due_fragments
from p2p_diloco.core.grace import GraceWindow
from p2p_diloco.core.merging import token_weight
from p2p_diloco.core.outer import GlobalState, OuterOptimizer, apply_result
from p2p_diloco.core.pace import Pace
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.learner.audit import Audit
from p2p_diloco.learner.catch_up import CatchUp
from p2p_diloco.learner.metrics import Metrics
from p2p_diloco.learner.phase import Phase
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.round import OuterRound, RoundOutcome, Stage
from p2p_diloco.learner.state import LearnerState, Unconfirmed
from p2p_diloco.trust.certificates import Certifier

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A fragment round running (or run) on its own copy of the fragment's state."""

    fragment: Fragment
    apply_at: int  # the inner step at which its result is due (τ steps after it started)
    snapshot: list[torch.Tensor]  # θ_f when the round started (for the mix policy)
    tokens: int
    steps: int
    window: float
    state: GlobalState  # the round's own copy of the fragment's state; it becomes ours if committed
    thread: threading.Thread | None = None
    outcome: RoundOutcome | None = None
    lr_steps: float | None = None  # the steps counted at the peak lr (exclusion.py): ``steps`` when None
    started: float = field(default_factory=time.perf_counter)
    overran: bool = False  # the pace has counted it as a round that outlived its slot

    def unconfirmed(self, version: int) -> Unconfirmed:
        """What this round sent, started from ``version``, until we know whether it was committed."""
        return Unconfirmed(version, self.snapshot, self.tokens, self.steps, self.lr_steps)

    def running(self) -> bool:
        """Whether the round's thread is still running (False for a round run in the foreground)."""
        return self.thread is not None and self.thread.is_alive()


@dataclass
class Rounds:
    """The learner's fragment rounds. At most one round is in flight (``inflight``), plus at most one
    that outlived its wait and runs on detached (``detached``)."""

    cfg: LearnerConfig
    state: LearnerState
    averaging: Averaging
    outer_opt: OuterOptimizer
    grace: GraceWindow
    clock: ClockSchedule | None
    catch_up: CatchUp
    progress: Progress
    on_commit: Callable[[], None]  # after a commit is applied (the learner checkpoints, with run.checkpoint_on_commit)
    certifier: Certifier | None = None  # signs what a round commits (None: no certificates, for tests)
    inflight: InFlight | None = None
    detached: InFlight | None = None  # a round we stopped waiting for at τ; still running
    audit: Audit = field(default_factory=Audit.disabled)  # audit.jsonl: each round's outcome
    last_outcome: RoundOutcome | None = None
    pending: dict[int, float] = field(default_factory=dict)  # fragment → deadline (monotonic) of a slot
    late: set[int] = field(default_factory=set)  # pending slots that waited for the round before them (clock)
    metrics: Metrics = field(default_factory=Metrics)
    pace: Pace | None = None  # sync.pace = auto: the clock's period and τ follow measurements
    faults: FaultHooks = NO_FAULTS  # test-only fault injection, handed to each round
    phase: Phase = field(init=False)  # steps schedule: our phase against the swarm's rounds

    def __post_init__(self) -> None:
        self.phase = Phase(self.cfg, self.state, self.averaging)

    def overlap(self) -> int:
        """τ for the next round: measured (sync.pace = auto) or as configured."""
        return self.pace.overlap() if self.pace is not None else self.cfg.sync.overlap_steps

    def observe_step(self, seconds: float) -> None:
        """One inner step took ``seconds``: the grace window and the pace measure it."""
        self.grace.observe_step(seconds)
        if self.pace is not None:
            self.pace.observe_step(seconds)

    def tick(self) -> None:
        """After each inner step: apply a due result, adopt downloads, start the rounds that are due."""
        if self.inflight is not None and self.state.counters.inner_steps >= self.inflight.apply_at:
            self.finish()
        self.catch_up.poll(busy=self.inflight.fragment.index if self.inflight is not None else None)
        self.poll_detached()
        self.sync_due_fragments()

    def drain(self) -> None:
        """The training loop has ended: apply the round in flight, wait (bounded) for a late one."""
        if self.inflight is not None:
            self.finish()
        if self.detached is not None and self.detached.thread is not None:
            self.detached.thread.join(timeout=self.cfg.averaging.round_timeout)
            self.poll_detached()
        self.catch_up.finish()

    def start(self, frag: Fragment, background: bool | None = None, search_seconds: float | None = None) -> None:
        """Start fragment ``frag``'s round: in the background when τ > 0 (applied at ``apply_at``),
        else (or with ``background=False``) here, applying its result before returning. ``search_seconds``:
        how long its search for a group may last at most (None: ``averaging.round_timeout``)."""
        cfg, c, f = self.cfg, self.state.counters, frag.index
        tau = self.overlap()
        if background is None:
            background = tau > 0
        self.grace.overlap_steps = tau
        window = self.grace.choose()
        task = InFlight(
            fragment=frag, apply_at=c.inner_steps + tau,
            snapshot=self.state.snapshot(frag), tokens=c.tokens_since_merge[f],
            steps=c.steps_since_merge[f], window=window, state=self.state.states[f].copy(),
            lr_steps=c.lr_steps_since_merge[f],
        )
        # The round works on a copy: the training thread reads and checkpoints the states while it
        # runs, and must never see a fragment half-way through the outer step.
        rnd = OuterRound(
            state=task.state, optimizer=self.outer_opt, averaging=self.averaging, local_params=task.snapshot,
            tokens=task.tokens, inner_steps=task.steps, lr_steps=task.lr_steps,
            max_delta_norm=cfg.averaging.max_delta_norm,
            weight=token_weight(task.tokens, task.steps, c.missed_versions[f], cfg.sync.weighting),
            fragment=f, rda=cfg.sync.rda and not frag.has_embedding, grace=window, certifier=self.certifier,
            verify_reducers=cfg.averaging.verify_reducers, steps_per_outer=cfg.inner.steps_per_outer,
            search_seconds=search_seconds, faults=self.faults,
        )

        def run() -> None:
            task.outcome = rnd.run()  # never raises: failures are outcomes (round.py)

        self.inflight = task
        if background:
            task.thread = threading.Thread(target=run, daemon=True, name=f"round-fragment-{f}")
            task.thread.start()
            return
        waited = time.perf_counter()
        run()
        c.wait_seconds += time.perf_counter() - waited
        self.finish()

    def finish(self) -> RoundOutcome | None:
        """Join the round in flight (blocking if it is late, up to ``sync.max_wait_seconds``) and apply
        its result locally. Returns None when it is still running after that: see :meth:`_detach`."""
        task, c = self.inflight, self.state.counters
        if task is None:
            return None
        if task.thread is not None:
            waited = time.perf_counter()
            task.thread.join(timeout=self.cfg.sync.max_wait_seconds)
            c.wait_seconds += time.perf_counter() - waited
            if task.thread.is_alive():
                self._detach(task, time.perf_counter() - waited)
                return None
        self.inflight = None
        out, f = self._ended(task, late=False), task.fragment.index
        self.last_outcome = out
        if out.committed:
            self._apply(task)
        else:
            self._failed()
            self.progress.stale = True  # the swarm may have moved on: the next catch-up looks it up afresh
            if task.tokens > 0:
                # Our outer gradient may have reached reducers whose group committed without us.
                self.state.unconfirmed[f] = task.unconfirmed(self.state.states[f].version)
        status = "committed" if out.committed else f"not committed ({out.reason}); local progress kept"
        logger.log(
            logging.INFO if out.committed else logging.WARNING,
            f"outer round {status} | version {self.state.states[f].version} fragment {f}/{len(self.state.fragments)} "
            f"group {out.group_size} window {task.window:.2f}s allreduce {out.allreduce_seconds:.2f}s "
            f"round {out.round_seconds:.2f}s sent {out.bytes_sent / 1e6:.3f} MB"
            + (f" certified in {out.certify_seconds:.2f}s" if out.committed else "")
        )
        return out

    def _ended(self, task: InFlight, late: bool) -> RoundOutcome:
        """A round of ours has ended, on time or ``late`` (detached): the one place it is measured, counted and
        audited. A late round is the slow link the pace and the grace window exist for: unmeasured, every round
        on a 1 Mbit/s link outlived its wait, the period stayed at its starting 60 s and fragment 1's slot was
        skipped for the first 7 minutes (WAN benchmark)."""
        out, f = _outcome(task), task.fragment.index
        self.audit.round(f, out, self.cfg.codec_for(f), task.tokens, late=late)
        self.state.counters.bytes_sent += out.bytes_sent
        self.grace.observe_round(out.round_seconds, out.allreduce_seconds, task.window)
        if self.pace is not None:
            self.pace.observe_round(out.round_seconds, out.group_size)
        self.metrics.round(f, out)
        return out

    def _apply(self, task: InFlight) -> None:
        """A committed round's result becomes ours, on time or late: the one door for a round's result."""
        f, c = task.fragment.index, self.state.counters
        self.state.states[f] = self.state.pin(task.state)
        self.state.unconfirmed.pop(f, None)
        apply_result(self.state.local(task.fragment), task.state.params, task.snapshot, self.cfg.sync.apply_policy)
        self.state.changed.add(f)
        c.outer_steps += 1
        # Tokens taken during the overlap were not part of this round; they count for the next one.
        c.merged(f, task.tokens, task.steps, len(self.state.fragments), task.lr_steps)
        c.missed_versions[f] = 0
        self.phase.committed()
        self.state.refresh_served()
        self.averaging.set_state_priority(self.state.version)
        self.on_commit()

    def _failed(self) -> None:
        self.state.counters.rounds_failed += 1
        self.phase.failed()

    def _detach(self, task: InFlight, waited: float) -> None:
        """Train on without a round that outlived ``sync.max_wait_seconds`` past τ (a groupmate died
        mid-round, say, and hivemind's all-reduce timeout has not fired yet).

        The round keeps running on its own copy of the fragment's state. If it commits, its result is
        applied when it ends (:meth:`poll_detached`); if it fails, our outer gradient waits for a
        later round. Until then it is unconfirmed, so that if the others commit it while we learn of
        it only from their state, it is not contributed twice (docs/resilience.md).
        """
        f = task.fragment.index
        self.inflight, self.detached = None, task
        self.state.unconfirmed[f] = task.unconfirmed(self.state.states[f].version)
        logger.warning(f"fragment {f}: round still running after waiting {waited:.1f} s at τ; training on (its "
                       "result is applied if it commits)")

    def poll_detached(self) -> None:
        """Take the result of a detached round once it has ended."""
        task = self.detached
        if task is None or task.running():
            return
        self.detached = None
        out, f = self._ended(task, late=True), task.fragment.index
        if not out.committed:
            self._failed()
            logger.info(f"fragment {f}: the round we stopped waiting for ended without a commit ({out.reason}); "
                        "local progress kept")
            return
        logger.info(f"fragment {f}: the round we stopped waiting for committed version {task.state.version}")
        ours = self.state.states[f]
        if task.state.descends_from(ours.version, ours.sha256()) and task.state.version == ours.version + 1:
            self._apply(task)  # nothing else changed the fragment meanwhile: as if it had been on time
            return
        if self.catch_up.downloading(f):
            return  # a newer state of it is on the way; this one is adopted (or superseded) with it
        # A download moved the fragment meanwhile: the result comes in like any peer's state.
        self.state.counters.outer_steps += 1
        self.phase.out = False
        if f in self.catch_up.adopt({f: task.state}):
            self.state.counters.missed_versions[f] = 0  # our own round, not a version we missed

    def due(self) -> list[Fragment]:
        """Fragments that became due: at their wall-clock slot (each slot once), or on the steps schedule when the
        inner step plus the phase's shift (:class:`~p2p_diloco.learner.phase.Phase`) reaches their offset.
        """
        if self.clock is not None:
            now = get_dht_time()
            change = self.pace.due_change(now) if self.pace is not None else None
            if change is not None:
                self.clock.retime(*change)
                logger.info(f"round period now {change[0]:.1f} s (τ {self.overlap()} steps)")
            return self.clock.due(now)
        return due_fragments(self.state.fragments, self.phase.steps(), self.cfg.inner.steps_per_outer)

    def at_target(self, fragment: int) -> bool:
        """Whether ``fragment`` has reached ``run.max_outer_steps``: no more rounds of it."""
        target = self.cfg.run.max_outer_steps
        return target is not None and self.state.states[fragment].version >= target

    def rephase(self) -> None:
        """Steps schedule: before our first commit, and after a round without one, join a round the others
        are forming now (:meth:`Phase.look <p2p_diloco.learner.phase.Phase.look>`), while no round of ours runs."""
        if self.clock is not None or self.inflight is not None or self.detached is not None:
            return
        joined = self.phase.look(self.state.fragments, lambda f: f in self.pending or self.at_target(f))
        if joined is not None:
            self.pending[joined.index] = float("inf")

    def sync_due_fragments(self) -> None:
        """Open the slots of the fragments due now and start each round whose slot is open."""
        now = time.monotonic()
        self.rephase()
        for frag in self.due():
            # On the clock schedule a slot stays open while the group forms (matchmaking time): a
            # learner whose previous round is about to end still joins. On the steps schedule the
            # slot waits for the previous round (the overlap budget ran out).
            patience = self.cfg.averaging.matchmaking_time if self.clock is not None else float("inf")
            self.pending[frag.index] = now + patience
        for f in list(self.pending):
            if self.inflight is not None:
                if not self.inflight.running() or self.clock is None:
                    self.finish()  # its result is ready (or the overlap budget ran out): apply it now
                elif now < self.pending[f]:
                    self.late.add(f)
                    continue  # keep training; look again after the next inner step
                else:
                    del self.pending[f]
                    self.late.discard(f)
                    # The fragment's progress waits for its next slot.
                    logger.info(f"skipped fragment {f}'s slot: fragment {self.inflight.fragment.index}'s "
                                "round is still in flight")
                    self._overran(self.inflight)
                    continue
            del self.pending[f]
            late = f in self.late
            self.late.discard(f)
            self._open_slot(self.state.fragments[f], late)

    def _open_slot(self, frag: Fragment, late: bool = False) -> None:
        """Start fragment ``frag``'s round at its slot, unless something says it would be wasted. ``late``: the
        slot waited for the round before it to end (clock schedule)."""
        f = frag.index
        if self.detached is not None:
            # The averager is still busy with the round we stopped waiting for: a round now would
            # only queue behind it. This fragment's progress waits for its next slot.
            logger.info(f"skipped fragment {f}'s slot: fragment {self.detached.fragment.index}'s late round is "
                        "still running")
            self._overran(self.detached)
            return
        background = self.overlap() > 0
        merges = self.state.counters.merges
        changed = self.catch_up.start(background=background)
        if self.catch_up.downloading(f):
            # The swarm committed this fragment without us. Skipping this round (rather than
            # waiting alone for a group) keeps us in phase: on the steps schedule the swarm's next
            # round of it is about H steps away, as is ours. Our progress stays in θ and counts
            # next time.
            logger.info(f"fragment {f}: its newer state is on the way; contributing at its next slot")
            return
        if f in changed and self.state.counters.merges == merges and self._wait_for_the_swarm(f):
            return
        if self.at_target(f):
            return
        # A latecomer alone at its slot looks only while a group of latecomers like it could form.
        self.start(frag, search_seconds=self.cfg.averaging.matchmaking_time if late and self._alone_at(f) else None)
        if not background and self.last_outcome is not None and self.last_outcome.superseded:
            # Late for the swarm's round: take its newer Θ (our steps are rebased onto it).
            self.catch_up.start()
            if not self._wait_for_the_swarm(f) and not self.at_target(f):
                self.start(frag)

    def _overran(self, task: InFlight) -> None:
        """A slot was skipped for ``task``, still running: the pace counts it once as a round at least that long,
        if it found a group (a search that finds none measures its timeout, not the link, as in
        :meth:`Pace.observe_round <p2p_diloco.core.pace.Pace.observe_round>`)."""
        if self.pace is not None and not task.overran and self.averaging.grouped():
            task.overran = True
            self.pace.observe_overrun(time.perf_counter() - task.started)

    def _alone_at(self, f: int) -> bool:
        """Clock schedule, a slot opened late (the round before it ended within the slot's patience): whether
        nobody is looking for a group of fragment ``f`` at our version, so that a search now would find no one
        who came on time.

        Whether the round before a slot ends in time differs between learners by seconds (certificates, a
        slower member's share of the all-reduce): at 1 Mbit/s three learners skipped a slot that the fourth,
        a few seconds ahead of them, opened; it searched alone for 31 s (``round_timeout``), and that round,
        still in flight, made it skip its next slot too (WAN benchmark). Such a latecomer's search
        is cut to the slot's window: other latecomers, whose rounds ended as late as its own, can still meet
        it there (had everyone come late, skipping would lose the slot for all), and alone it is free again
        within seconds. A failed DHT look counts as someone looking (the search runs its full time).
        """
        looked = time.perf_counter()
        others = self.phase.searching(f)
        self.state.counters.wait_seconds += time.perf_counter() - looked
        if others is None or others:
            return False
        logger.info(f"fragment {f}: we came late to its slot and nobody is looking for a group of it at version "
                    f"{self.state.states[f].version}: a short search (only latecomers like us can still come)")
        return True

    def _wait_for_the_swarm(self, f: int) -> bool:
        """The swarm committed fragment ``f`` without us: whether our steps wait for its next round
        (:meth:`Phase.wait_for_the_swarm <p2p_diloco.learner.phase.Phase.wait_for_the_swarm>`). On the clock
        schedule everyone's slot is the same, so a learner that took a state at its slot is on time for it."""
        return self.clock is None and not self.at_target(f) and self.phase.wait_for_the_swarm(f)

    def in_limbo(self) -> dict[int, Unconfirmed]:
        """The round in flight's outer gradient, whose outcome is unknown until it is applied."""
        task = self.inflight
        if task is None:
            return {}
        f = task.fragment.index
        return {f: task.unconfirmed(self.state.states[f].version)}

    def join_threads(self) -> None:
        """Wait for the round threads still running, each at most the round timeout + 5 s (on shutdown)."""
        for task in (self.inflight, self.detached):
            if task is not None and task.thread is not None:
                task.thread.join(timeout=self.cfg.averaging.round_timeout + 5)


def _outcome(task: InFlight) -> RoundOutcome:
    if task.outcome is None:  # the round thread died without an outcome (it latches its errors)
        return RoundOutcome(stage=Stage.FAILED, reason="the round ended without an outcome")
    return task.outcome
