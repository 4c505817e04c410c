"""A learner whose own training diverges heals itself from the swarm's global state.

An inner step whose loss is not finite (NaN or ±Inf: a bad batch, a too-high learning rate, a
hardware fault) leaves θ and the inner optimizer's moments poisoned: every later step is NaN, the
learner's outer gradients are left out of every round (core/exclusion.py, rule 1) and it would
train on NaN to the end. Instead the learner **heals**: θ of every fragment ← its global state Θ
(the swarm's last committed model, which it holds), the inner optimizer starts fresh (with the
re-warm-up of a rejoining learner, trainer.py), its unmerged tokens and steps are dropped (they are
gone with the poisoned θ: claiming them would be a free ride), one WARNING line, and it trains on.

A learner that diverges :data:`MAX_HEALS` times within :data:`WINDOW_ROUNDS` outer steps' worth of
inner steps stops with a clear error: its settings or its data, not bad luck, are at fault.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.state import LearnerState

logger = logging.getLogger(__name__)

MAX_HEALS = 3
WINDOW_ROUNDS = 3  # the window of MAX_HEALS, in outer steps (H inner steps each)


@dataclass
class Healing:
    """Watches each inner step's loss; :meth:`after_step` heals the learner when it is not finite."""

    steps_per_outer: int
    heals: int = 0
    _recent: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_HEALS))

    def after_step(self, loss: float, state: LearnerState, trainer: Restartable) -> bool:
        """Heal if ``loss`` is not finite (True when it did). Raises :class:`LearnerError` on the
        :data:`MAX_HEALS`-th divergence within the window."""
        if math.isfinite(loss):
            return False
        step = state.counters.inner_steps
        self._recent.append(step)
        window = WINDOW_ROUNDS * self.steps_per_outer
        if len(self._recent) == MAX_HEALS and step - self._recent[0] <= window:
            raise LearnerError(f"this learner's training diverged (loss {loss}) {MAX_HEALS} times within {window} "
                               f"inner steps, each time restarted from the swarm's global state: lower inner.lr, "
                               f"set inner.grad_clip, or check this learner's data")
        take_global_state(state)
        trainer.restart_optimizer()
        self.heals += 1
        logger.warning(f"inner step {step}: loss {loss}; took the swarm's global state back (version "
                       f"{state.version}), reset the inner optimizer and dropped the unmerged steps; training on")
        return True


class Restartable(Protocol):
    """What healing needs of the trainer (:class:`p2p_diloco.train.trainer.Trainer`)."""

    def restart_optimizer(self) -> None: ...


def take_global_state(state: LearnerState) -> None:
    """θ ← Θ for every fragment, and no unmerged progress."""
    with torch.no_grad():
        for frag, global_state in zip(state.fragments, state.states, strict=True):
            for local, theta in zip(state.local(frag), global_state.params, strict=True):
                local.copy_(theta)
            state.changed.add(frag.index)
    c = state.counters
    n = len(state.fragments)
    c.tokens_since_merge, c.steps_since_merge, c.lr_steps_since_merge = [0] * n, [0] * n, [0.0] * n
