"""What a learner holds, shared by its parts: the global state per fragment, the local parameters,
the counters, and the exactly-once ledger of outer gradients sent to rounds it did not see end.

This module sits at the bottom of the learner: rounds, catch-up, parting and progress records all
read and change a :class:`LearnerState`, and none of them imports another's module to do so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from p2p_diloco.core import standing as standings
from p2p_diloco.core.fragments import Fragment
from p2p_diloco.core.outer import GlobalState
from p2p_diloco.core.state_layout import ServedState, whole_sha256


@dataclass
class Counters:
    """Totals reported in the summary and saved in every checkpoint (``vars(counters)``)."""

    inner_steps: int = 0
    tokens: int = 0
    outer_steps: int = 0  # fragment rounds this learner committed
    steps_merged: float = 0.0  # inner steps whose progress entered the global model (counted per fragment round / P)
    rounds_failed: int = 0
    heals: int = 0  # inner steps whose loss was not finite: θ taken back from Θ (healing.py)
    loss_rises: int = 0  # evals more than run.loss_rise_alert above the previous one (loop.py)
    syncs: int = 0
    merges: int = 0  # sibling lineages (split brain) this learner merged
    bytes_sent: int = 0
    bytes_received: int = 0  # all-reduce parts and results, state downloads (failed ones too)
    compute_seconds: float = 0.0  # wall time inside inner steps
    wait_seconds: float = 0.0  # wall time blocked on a round (overlap budget exceeded, or τ = 0)
    download_seconds: float = 0.0  # wall time of background state downloads (inner steps went on)
    # rounds this learner did not see commit whose contributors list showed its outer gradient in Θ
    contributions_confirmed: int = 0
    train_seconds: float = 0.0  # wall time of the training loop (inner steps, rounds, evals, checkpoints)
    first_eval_loss: float | None = None
    # per fragment, since that fragment's last committed round:
    tokens_since_merge: list[int] = field(default_factory=list)
    steps_since_merge: list[int] = field(default_factory=list)
    # the same steps, each counted as (its lr / the peak lr)²: what they weigh in the outlier rule (exclusion.py)
    lr_steps_since_merge: list[float] = field(default_factory=list)
    missed_versions: list[int] = field(default_factory=list)

    _received_lock: ClassVar[threading.Lock] = threading.Lock()  # rounds and downloads count from their threads

    def count_received(self, n: int) -> None:
        """``n`` more bytes came in from the network (the averaging's ``on_received``)."""
        with self._received_lock:
            self.bytes_received += n

    def resize(self, fragments: int) -> None:
        """Reset the per-fragment counters to zeros for ``fragments`` fragments."""
        self.tokens_since_merge = [0] * fragments
        self.steps_since_merge = [0] * fragments
        self.lr_steps_since_merge = [0.0] * fragments
        self.missed_versions = [0] * fragments

    def count_step(self, tokens: int, lr_share: float) -> None:
        """One inner step of ``tokens`` tokens at (lr / peak lr)² = ``lr_share``, on every fragment."""
        self.inner_steps += 1
        self.tokens += tokens
        for f in range(len(self.steps_since_merge)):
            self.tokens_since_merge[f] += tokens
            self.steps_since_merge[f] += 1
            self.lr_steps_since_merge[f] += lr_share

    def merged(self, fragment: int, tokens: int, steps: int, fragments: int, lr_steps: float | None = None) -> None:
        """``steps`` inner steps (``tokens`` tokens, ``lr_steps`` at the peak lr) of ours on ``fragment`` entered
        the global state. Without ``lr_steps``, they take their share of the fragment's by their number."""
        before = self.steps_since_merge[fragment]
        if lr_steps is None:
            lr_steps = self.lr_steps_since_merge[fragment] * min(1.0, steps / before) if before else 0.0
        self.tokens_since_merge[fragment] = max(0, self.tokens_since_merge[fragment] - tokens)
        left = self.steps_since_merge[fragment] = max(0, before - steps)
        # No steps left, none at the peak lr either; never more at the peak lr than steps.
        self.lr_steps_since_merge[fragment] = min(float(left), max(0.0, self.lr_steps_since_merge[fragment] - lr_steps))
        self.steps_merged += steps / fragments

    def fill_lr_steps(self) -> None:
        """A checkpoint from before ``lr_steps_since_merge``: its unmerged steps count as steps at the peak lr."""
        if len(self.lr_steps_since_merge) != len(self.steps_since_merge):
            self.lr_steps_since_merge = [float(s) for s in self.steps_since_merge]


@dataclass
class Unconfirmed:
    """An outer gradient this learner may have given to a round it did not see commit.

    The round started from ``version`` of the fragment with the learner at ``snapshot``. If the
    swarm's state for ``version + 1`` lists this learner among its contributors, the progress up to
    ``snapshot`` is in Θ already and must not be contributed again (docs/resilience.md).
    """

    version: int
    snapshot: list[torch.Tensor]
    tokens: int
    steps: int
    lr_steps: float | None = None  # those steps at the peak lr (None: unknown, a share of the fragment's by count)


@dataclass
class LearnerState:
    """The model as one learner holds it: P fragments, each with its global state Θ_f (shared with
    the swarm, bit-identical among learners at the same version) and its local parameters θ_f."""

    fragments: list[Fragment]
    states: list[GlobalState]
    params: Sequence[torch.Tensor]  # the local model's parameters, in module order
    counters: Counters = field(default_factory=Counters)
    unconfirmed: dict[int, Unconfirmed] = field(default_factory=dict)  # fragment → outer gradient in limbo
    served: ServedState = field(default_factory=ServedState)
    peer_id: str = ""
    # A learner training on CUDA keeps Θ and the outer momentum in pinned host memory: copies into θ
    # on the device then go by DMA, without a staging copy (trainer.py, "What lives where").
    pin_memory: bool = False
    # Fragments whose θ changed outside an inner step (a round's result applied, a download adopted
    # or rebased onto, a checkpoint restored) since a learner unit last sent them to its other
    # workers (unit.py drains it at each step; a learner of one worker leaves it be).
    changed: set[int] = field(default_factory=set)
    # Called with a fragment before its θ is handed out (:meth:`local`): rank 0 of a unit whose model is
    # sharded brings its host copy of θ_f up to date there (leader.py); None elsewhere.
    before_local: Callable[[Fragment], None] | None = None

    def __post_init__(self) -> None:
        for s in self.states:
            self.pin(s)

    @property
    def versions(self) -> list[int]:
        """Each fragment's version, in fragment order."""
        return [s.version for s in self.states]

    @property
    def version(self) -> int:
        """The oldest fragment's version: the learner's round number."""
        return min(self.versions, default=0)

    def local(self, fragment: Fragment) -> list[torch.Tensor]:
        """θ_f: the local parameters of one fragment (views, trained in place)."""
        if self.before_local is not None:
            self.before_local(fragment)
        return [self.params[i] for i in fragment.tensor_indices]

    def snapshot(self, fragment: Fragment) -> list[torch.Tensor]:
        """θ_f copied to the CPU in fp32, wherever θ trains: the start of a round's outer gradient and of
        the ``mix`` policy (the same bits as ``clone()`` for a CPU fp32 model)."""
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self.local(fragment)]

    def pin(self, state: GlobalState) -> GlobalState:
        """``state`` itself, its tensors moved to pinned memory first if :attr:`pin_memory` (a global state
        from a round, a download or a checkpoint, before it becomes one of :attr:`states`)."""
        if self.pin_memory:
            state.params = [t if t.is_pinned() else t.pin_memory() for t in state.params]
            state.momentum = [t if t.is_pinned() else t.pin_memory() for t in state.momentum]
        return state

    def established(self, after: int, floor: int, fragment: int | None = None) -> frozenset[str] | None:
        """The established peers by one fragment's standing, or by every fragment's (``fragment`` None: the
        quorum's base, which each fragment's group check must be able to meet): see
        :func:`p2p_diloco.core.standing.established`; None while everyone counts (in any fragment, for None).
        A fragment we do not have (a peer's certificate may name any): nobody."""
        if fragment is not None and not 0 <= fragment < len(self.states):
            return frozenset()
        chosen = self.states if fragment is None else [self.states[fragment]]
        found = [standings.established(s.standing, after, floor) for s in chosen]
        if not found or any(e is None for e in found):
            return None
        return frozenset.intersection(*[e for e in found if e is not None])

    def whole_sha256(self) -> str:
        """One hash of every fragment's global state: equal on learners holding the same model."""
        return whole_sha256(self.states)

    def global_params(self) -> list[torch.Tensor]:
        """Θ in module order, assembled from the fragments (the tensors themselves, not copies)."""
        out: list[torch.Tensor] = list(self.params)
        for frag, state in zip(self.fragments, self.states, strict=True):
            for i, t in zip(frag.tensor_indices, state.params, strict=True):
                out[i] = t
        return out

    def refresh_served(self) -> None:
        """Serve a new snapshot of :attr:`states` to downloading peers; call it after every change of them."""
        self.served.refresh(self.states)

    def pending_for_checkpoint(self, extra: dict[int, Unconfirmed]) -> list[dict]:
        """The ledger as saved in a checkpoint, plus ``extra`` (a round in flight: unknown outcome)."""
        return [{"fragment": f, **vars(u)} for f, u in {**self.unconfirmed, **extra}.items()]


def same_or_behind(ours: GlobalState, theirs: GlobalState) -> bool:
    """``theirs`` is our state or one of its ancestors: nothing to take."""
    return theirs.sha256() == ours.sha256() or ours.descends_from(theirs.version, theirs.sha256())
