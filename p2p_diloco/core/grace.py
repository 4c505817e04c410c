"""The adaptive grace window: how long a learner waits for more groupmates after the quorum.

Each learner decides from its own clock. With overlap τ, a round has τ inner steps of compute to
hide behind before the learner needs its result:

    slack = τ · t_step − (t_quorum + t_sync)
    grace = clamp(γ · slack, floor, ceiling)      with γ < 1

t_step, t_quorum (matchmaking time beyond the window) and t_sync (the all-reduce itself) are
exponential moving averages of what this learner measured. The floor is hivemind's minimum
matchmaking time: below it groups do not reliably form at all. Without slack (τ = 0, or a network
slower than τ steps of compute) the window stays at the floor, so waiting for stragglers never
shows in a learner's compute more than the floor does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GraceWindow:
    """The grace formula of the module docstring, fed with this learner's own measurements; all times in seconds.

    t_step, t_quorum and t_sync are exponential moving averages (weight ``smoothing`` for the newest value).
    """
    overlap_steps: int
    gamma: float
    floor: float
    ceiling: float
    smoothing: float = 0.2
    t_step: float | None = None
    t_quorum: float | None = None
    t_sync: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_step(self, seconds: float) -> None:
        """Fold the duration of one inner step (seconds) into t_step."""
        self.t_step = self._ema(self.t_step, seconds)

    def observe_round(self, round_seconds: float, allreduce_seconds: float, window: float) -> None:
        """Fold one finished round in: time beyond the window waiting for a quorum, and the sync."""
        self.t_quorum = self._ema(self.t_quorum, max(0.0, round_seconds - allreduce_seconds - window))
        self.t_sync = self._ema(self.t_sync, allreduce_seconds)

    @property
    def slack(self) -> float:
        """τ · t_step − (t_quorum + t_sync), in seconds; unmeasured terms count as 0, and it may be negative."""
        return self.overlap_steps * (self.t_step or 0.0) - ((self.t_quorum or 0.0) + (self.t_sync or 0.0))

    def choose(self) -> float:
        """The grace window for the next round, in seconds: γ · slack clamped to [floor, ceiling]."""
        return min(self.ceiling, max(self.floor, self.gamma * self.slack))
