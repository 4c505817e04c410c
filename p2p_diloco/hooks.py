"""Where scripted faults reach production code: one hook object, passed in through constructors.

A learner, its averaging and its all-reduce call these methods at the points a failure is
injected; :class:`FaultHooks` itself does nothing there (a learner's default), and
:class:`p2p_diloco.sim.faults.FaultPlan` overrides them to carry out a test's or ``--faults``' plan
(kill, hang, drop, poison, lie, malform). No production module imports :mod:`p2p_diloco.sim`.

Stages (:meth:`FaultHooks.fire`, :meth:`FaultHooks.due`): ``inner``, ``matchmaking``, ``send``,
``reduce``, ``receive``, ``commit``, ``checkpoint``, ``serve``; a round R is the round that
produces global version R of a fragment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the CLI checks a plan without loading torch
    import torch

M = TypeVar("M")


class FaultHooks:
    """No fault: every hook returns what it was given."""

    def fire(self, stage: str, round_: int, group: int = 0) -> None:
        """Carry out the fault due at ``stage`` of ``round_``, if any (each fires once); ``group``: how many
        members the round's group has, where the stage knows it (``commit``), else 0."""

    def due(self, stage: str, round_: int) -> bool:
        """Whether :meth:`fire` with these arguments would carry out a fault."""
        return False

    def outer_gradient(self, deltas: Sequence[torch.Tensor], round_: int) -> list[torch.Tensor]:
        """The outer gradient this learner sends in ``round_`` (``poison``)."""
        return list(deltas)

    def inner_gradients(self, params: Sequence[torch.Tensor], round_: int) -> None:
        """Change the loss gradients of an inner step toward ``round_`` before clipping (``poison ... with climb``)."""

    def gathered_weight(self, weight: float, round_: int) -> float:
        """The weight this learner gathers for its outer gradient in ``round_`` (``lie ... with weight``)."""
        return weight

    def claimed_versions(self, versions: tuple[int, ...]) -> tuple[int, ...]:
        """The fragment versions this learner's progress record claims (``lie ... with ahead``)."""
        return versions

    def reduced_shard(self, averaged: torch.Tensor, round_: int) -> torch.Tensor:
        """The averaged shard this learner returns as a reducer in ``round_`` (``lie ... with shard``)."""
        return averaged

    def withholds_sketch(self, round_: int) -> bool:
        """Whether this learner keeps its reducer sketch of ``round_`` to itself (``lie ... with sketch``)."""
        return False

    def signed_sha(self, sha: str, round_: int) -> str:
        """The hash of the new state this learner signs in ``round_``'s commit (``lie ... with hash``)."""
        return sha

    def gathered_quorum(self, quorum: int, round_: int) -> int:
        """The majority quorum this learner gathers in ``round_`` (``lie ... with quorum``)."""
        return quorum

    def wire_messages(self, message: M, index: int, round_: int) -> list[M]:
        """What this learner sends in place of the ``index``-th message of an all-reduce stream (``malform``)."""
        return [message]

    def served_states(self, states: Sequence[Any], version: int) -> Sequence[Any]:
        """The global states this learner serves to a downloader while it holds ``version``."""
        return states


NO_FAULTS = FaultHooks()
