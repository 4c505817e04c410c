"""The inner learning rate over training: linear warm-up, then constant or cosine decay.

Where a learner stands in the schedule follows the swarm, not its own step counter: position =
global version · H + the steps it has taken on that version (capped at H). A learner that joins
late (or restarts from nothing) downloads version v and continues at v·H with everyone else,
rather than warming up again at a high rate on a model the swarm has already annealed; a slow
learner's rate follows the global model's progress instead of lagging behind it. With equal
speeds the position equals the inner step count.
"""

from __future__ import annotations

import math

from p2p_diloco.config import InnerConfig


def inner_lr(cfg: InnerConfig, position: int, decay_steps: int | None) -> float:
    """The inner learning rate at schedule position ``position`` (0-based)."""
    if cfg.warmup_steps and position < cfg.warmup_steps:
        return cfg.lr * (position + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or decay_steps is None:
        return cfg.lr
    span = max(1, decay_steps - cfg.warmup_steps)
    done = min(1.0, (position - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * done))


class SchedulePosition:
    """Position in the schedule: version · H + steps taken on that version (at most H)."""

    def __init__(self, steps_per_outer: int):
        self.h = steps_per_outer
        self._version, self._steps = -1, 0

    def step(self, version: int) -> int:
        """Call once per inner step with the current global version; returns this step's position."""
        if version != self._version:
            self._version, self._steps = version, 0
        position = version * self.h + min(self._steps, self.h)
        self._steps += 1
        return position

    def state(self) -> list[int]:
        """[version, steps taken on it], for a checkpoint: a resumed learner goes on where it was."""
        return [self._version, self._steps]

    def load(self, state: list[int]) -> None:
        """Go on from a position saved by :meth:`state`; ValueError for a negative step count."""
        version, steps = (int(x) for x in state)
        if steps < 0:
            raise ValueError(f"lr schedule position: negative step count {steps}")
        self._version, self._steps = version, steps
