"""The averaging interface a round talks to, free of networking.

:class:`Averaging` is what an :class:`~p2p_diloco.learner.round.OuterRound` and the learner's parts call;
:class:`~p2p_diloco.net.averaging.HivemindAveraging` implements it over a hivemind DHT, unit
tests implement it in-process. A round's failures are values the caller catches: :class:`RoundFailed`
(no average that may be committed) and :class:`RoundSuperseded` (the swarm moved past our version).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from p2p_diloco.core.exclusion import Verdict

Served = tuple[dict[str, Any], list[torch.Tensor]]
StateProvider = Callable[[], Served]


class RoundFailed(RuntimeError):
    """The round did not produce an average that may be committed; the caller keeps its Δ."""


class RoundSuperseded(RoundFailed):
    """The swarm reached a newer version while we were looking for a group at ours."""


@dataclass
class AverageResult:
    """What a successful :meth:`Averaging.average` returns.

    ``deltas``: the average of the contributions that were not excluded, in the fragment's order;
    ``groupmates``: every member's gathered metadata, ours and the excluded members' included;
    ``allreduce_seconds``, ``bytes_sent``: the all-reduce's duration, what we sent; ``verdict``: who was
    excluded from the round and why, and the weights and clipping the average used
    (:func:`p2p_diloco.core.exclusion.judge` of ``groupmates``); ``sketch``: our sketch of the all-reduce, for
    checking the reducers (None: not made, e.g. under a robust aggregator).
    """
    deltas: list[torch.Tensor]
    groupmates: dict[str, dict[str, Any]]  # peer id -> metadata it gathered (version, sha, tokens, ...)
    allreduce_seconds: float
    bytes_sent: int
    verdict: Verdict = field(default_factory=Verdict)
    sketch: dict[str, Any] | None = None  # projections of what we sent and received (p2p_diloco/core/shard_sketches.py)
    sketch_key: str = ""  # where the group's members published theirs ("": not published, no signed records)

    @property
    def group_size(self) -> int:
        """Number of learners in the group, this one and any excluded ones included."""
        return len(self.groupmates)

    @property
    def contributors(self) -> list[str]:
        """The peers whose outer gradients the average holds, sorted."""
        return self.verdict.contributors(self.groupmates)


@runtime_checkable
class Averaging(Protocol):
    """Everything a learner asks of the network besides the DHT's progress records."""

    def average(
        self,
        deltas: Sequence[torch.Tensor],
        weight: float,
        metadata: dict[str, Any],
        version: int,
        fragment: int = 0,
        grace: float | None = None,
        search_seconds: float | None = None,
        standing: Mapping[str, int] | None = None,
    ) -> AverageResult:
        """Average ``deltas`` with a group at (``fragment``, ``version``); raise :class:`RoundFailed` if
        none forms or the group excluded our contribution, :class:`RoundSuperseded` when the swarm moved
        past ``version`` meanwhile. ``metadata`` is gathered to the group (with ``weight`` and what
        :mod:`p2p_diloco.core.exclusion` needs added). ``search_seconds``: how long to look for a group at most
        (None: ``averaging.round_timeout``); never less than the wait for the group's scheduled start. ``standing``:
        the fragment state's (:mod:`p2p_diloco.core.standing`: who counts toward the group's quorum, weight ramps)."""
        ...

    def set_state_priority(self, version: int) -> None:
        """Advertise the version we serve: downloaders try the newest first."""
        ...

    def searching_peers(self, fragment: int, version: int) -> int:
        """How many other peers are looking for a group at (``fragment``, ``version``) right now."""
        ...

    def grouped(self) -> bool:
        """Whether the round in progress has found its group (its all-reduce began); False between rounds."""
        ...

    def download_state(self, timeout: float) -> Served | None:
        """The newest global state any peer serves, or None."""
        ...

    def download_state_from(self, peer: str, timeout: float, fragments: Sequence[int] | None = None) -> Served | None:
        """The global state one given peer serves (only ``fragments``' tensors if given), or None."""
        ...

    def shutdown(self) -> None:
        """Stop averaging and serving state; called once, on the learner's way out."""
        ...
