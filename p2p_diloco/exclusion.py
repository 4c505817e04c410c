"""Which contributions a round leaves out: decided by every member from the same gathered metadata.

Every member of a group gathers every groupmate's metadata at matchmaking, before the all-reduce:
the same bytes at every member. From them alone :func:`judge` decides, with no networking and no
local state, who is **excluded** from the round, the **weight** each other contribution counts
with, and how much each is **clipped**. Members and reducers all call it, so they all leave out
the same peers, and a round's arithmetic never depends on what a part claims about itself.

The rule, applied to the members in sorted peer-id order:

1. **Broken.** Metadata that is not a dict, a ``finite`` flag that is False, a ``norm`` that is
   not finite (NaN/Inf), a ``weight`` or ``norm`` that is not a non-negative finite number:
   excluded ("its outer gradient is not finite").
2. **Outlier.** With ``norm_outlier_factor`` f > 0: a member whose norm per inner step (``norm /
   steps``: an honest learner that missed rounds sends many steps' progress at once) is above f
   times the median of the *other* valid members' is excluded. Leave-one-out, so that an outlier
   cannot raise its own yardstick, and so that the rule means something in tiny groups: alone,
   nobody is compared (only rule 1 applies); in a pair, the larger norm is excluded when it is
   more than f times the smaller one (with the plain median of two, their mean, no norm can
   ever be f ≥ 2 times the median, so a pair would never exclude anyone); from three members on
   it is the median of the others (with two others, their mean). A norm equal to f times the
   median stays in. In a pair the rule bets on the smaller norm: the failures seen in practice
   (diverging training, exploding updates, NaN) make norms larger, and a stalled learner's small
   outer gradient does little harm when averaged in.
3. **Banned.** Each member publishes the peers *it* excluded under rules 1-2 in its recent
   rounds (``bans``, kept by :class:`Bans`). A member is excluded when a strict majority of the
   other members that passed rules 1-2 list it. Only those members vote, so a broken or outlying
   member cannot ban anyone, and a single member cannot ban an honest majority away.

A member that gathered no ``weight`` counts with hivemind's default weight 1.0; one that gathered
no ``norm`` is not compared (our learners always gather both: the averaging layer sees to it).

Clipping: with ``max_contribution_norm`` c, a contribution of norm n > c is scaled by c / n
before it is averaged (reducers scale its parts; for radial-directional averaging, whose parts
are unit vectors, the round scales its norm instead).

Aggregation: ``aggregator`` (:mod:`p2p_diloco.aggregators`) is how each reducer combines the
contributions that are left: the token-weighted mean, or a coordinate-wise median or trimmed mean
that ignores the self-reported weights.

The thresholds themselves must be the same at every member, or members would disagree: each
member gathers its :class:`Rules` and :func:`agreed_rules` refuses a group whose members differ.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.aggregators import AGGREGATORS

logger = logging.getLogger(__name__)

MAX_BANS = 64  # entries of a groupmate's ban list that are read (a list can be no reason to allocate)


class RulesDisagree(ValueError):
    """Members of one group gathered different robust-merging rules: nobody may commit the round."""


@dataclass(frozen=True)
class Rules:
    """The robust-merging rules (``averaging.norm_outlier_factor``, ``averaging.max_contribution_norm``,
    ``averaging.aggregator``)."""

    norm_outlier_factor: float = 8.0  # 0 disables the outlier rule
    max_contribution_norm: float | None = None  # None: no clipping
    aggregator: str = "mean"  # how reducers combine contributions (p2p_diloco/aggregators.py)

    def gathered(self) -> list[float | str | None]:
        """The form a member gathers to its group."""
        return [float(self.norm_outlier_factor), self.max_contribution_norm, self.aggregator]


def agreed_rules(gathered: Mapping[str, Any], default: Rules) -> Rules:
    """The rules every member gathered (under ``"rules"``), or ``default`` when none gathered any.

    Raises :class:`RulesDisagree` when members gathered different or malformed rules.

    >>> agreed_rules({"a": {"rules": [4.0, None, "median"]}, "b": {"rules": [4.0, None, "median"]}}, Rules())
    Rules(norm_outlier_factor=4.0, max_contribution_norm=None, aggregator='median')
    """
    seen = {_frozen(m.get("rules") if isinstance(m, dict) else None) for m in gathered.values()}
    if len(seen) != 1:
        raise RulesDisagree(f"groupmates gathered different robust-merging rules: {sorted(map(str, seen))}")
    (only,) = seen
    if only is None:
        return default
    if not isinstance(only, tuple) or len(only) != 3 or only[2] not in AGGREGATORS:
        raise RulesDisagree(f"malformed robust-merging rules {only!r}")
    factor, cap = _number(only[0]), None if only[1] is None else _number(only[1])
    if factor is None or (only[1] is not None and (cap is None or cap <= 0)):
        raise RulesDisagree(f"malformed robust-merging rules {only!r}")
    return Rules(factor, cap, str(only[2]))


@dataclass(frozen=True)
class Exclusion:
    """Why one member's contribution is left out; ``banned``: only because groupmates ban it."""

    why: str
    banned: bool = False


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge` decided for one round.

    ``excluded``: peer → :class:`Exclusion`; ``weights``: each contributor's weight, from its gathered
    metadata; ``scales``: each contributor's clipping factor (1.0: not clipped); ``unit``: the
    contributors whose parts are unit vectors (radial-directional averaging).
    """

    excluded: dict[str, Exclusion] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    scales: dict[str, float] = field(default_factory=dict)
    unit: frozenset[str] = frozenset()
    aggregator: str = "mean"  # the rules' aggregator: how reducers combine the contributions

    def contributors(self, peers: Iterable[str]) -> list[str]:
        """``peers`` that are not excluded, sorted."""
        return sorted(p for p in peers if p not in self.excluded)

    def scale(self, peer: str) -> float:
        """The factor ``peer``'s outer gradient is clipped by (1.0 when it is not)."""
        return self.scales.get(peer, 1.0)

    def part_scale(self, peer: str) -> float:
        """The factor a reducer multiplies ``peer``'s parts by: its clip, unless its parts are unit vectors."""
        return 1.0 if peer in self.unit else self.scale(peer)


def judge(gathered: Mapping[str, Any], rules: Rules) -> Verdict:
    """Apply the module's rule to a group's gathered metadata (peer id → dict).

    >>> meta = lambda n: {"norm": n, "finite": True, "weight": 1.0}
    >>> v = judge({"a": meta(1.0), "b": meta(1.2), "c": meta(100.0), "d": meta(float("nan"))}, Rules(8.0))
    >>> sorted(v.excluded), v.excluded["d"].why
    (['c', 'd'], 'its outer gradient is not finite')
    """
    excluded: dict[str, Exclusion] = {}
    weights: dict[str, float] = {}
    norms: dict[str, float] = {}
    steps: dict[str, int] = {}
    for peer in sorted(gathered):
        meta = gathered[peer]
        why = _broken(meta)
        if why:
            excluded[peer] = Exclusion(why)
            continue
        weight = _number(meta.get("weight", 1.0))
        assert weight is not None  # checked by _broken
        weights[peer] = weight
        if meta.get("norm") is not None:
            norms[peer] = _number(meta["norm"]) or 0.0
            steps[peer] = _steps(meta)
    if rules.norm_outlier_factor > 0:
        # Per inner step: an honest learner that missed rounds sends the progress of many steps at once.
        rates = {p: n / steps[p] for p, n in norms.items()}
        for peer, rate in rates.items():
            others = [r for q, r in rates.items() if q != peer]
            if others and rate > rules.norm_outlier_factor * (median := statistics.median(others)):
                excluded[peer] = Exclusion(_outlier(rate, median, rules.norm_outlier_factor))
    voters = [p for p in sorted(weights) if p not in excluded]
    for peer in voters:
        electors = [q for q in voters if q != peer]
        votes = sum(peer in _bans(gathered[q]) for q in electors)
        if electors and 2 * votes > len(electors):
            excluded[peer] = Exclusion(f"banned by {votes} of {len(electors)} groupmates after an earlier exclusion",
                                       banned=True)
    cap = rules.max_contribution_norm
    scales = {p: cap / n for p, n in norms.items() if p not in excluded and cap is not None and n > cap}
    unit = frozenset(p for p in weights if p not in excluded and gathered[p].get("unit") is True)
    return Verdict(excluded, {p: w for p, w in weights.items() if p not in excluded}, scales, unit, rules.aggregator)


@dataclass
class Bans:
    """This learner's short bans: a peer it excluded (rules 1-2) is listed for its next ``rounds`` rounds.

    The list is gathered to every group (:meth:`listed`); :func:`judge` counts it as one vote.
    """

    rounds: int = 3
    _left: dict[str, int] = field(default_factory=dict)

    def listed(self) -> list[str]:
        """The peers this learner bans now, as it gathers them (sorted, at most :data:`MAX_BANS`)."""
        return sorted(self._left)[:MAX_BANS]

    def after_round(self, verdict: Verdict | None, me: str) -> list[str]:
        """Count one round of this learner; ban the peers ``verdict`` excluded on evidence (not ``me``).

        Returns the peers newly banned; each is logged once, when its ban starts.
        """
        self._left = {p: n - 1 for p, n in self._left.items() if n > 1}
        if verdict is None or self.rounds <= 0:
            return []
        new = []
        for peer, exclusion in sorted(verdict.excluded.items()):
            if exclusion.banned or peer == me:
                continue
            if peer not in self._left:
                new.append(peer)
                logger.info(f"{peer[-6:]} is banned from this learner's next {self.rounds} rounds")
            self._left[peer] = self.rounds
        return new


def _number(value: Any) -> float | None:
    """``value`` as a non-negative finite float, or None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def _broken(meta: Any) -> str:
    if not isinstance(meta, dict):
        return "its metadata is malformed"
    norm = meta.get("norm")
    not_finite = isinstance(norm, float) and not math.isfinite(norm)
    if meta.get("finite", True) is not True or not_finite:
        return "its outer gradient is not finite"
    if _number(meta.get("weight", 1.0)) is None:
        return f"its weight {meta.get('weight')!r} is invalid"
    if norm is not None and _number(norm) is None:
        return f"its norm {norm!r} is invalid"
    return ""


def _steps(meta: Mapping[str, Any]) -> int:
    """The inner steps behind a contribution (at least 1; a missing or bad count counts as 1)."""
    steps = meta.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else 1


def _outlier(rate: float, median: float, factor: float) -> str:
    if median == 0:
        return f"norm per inner step {rate:.2g} while the others' median is 0"
    return (f"norm per inner step {rate:.2g} is {rate / median:.0f}x the median {median:.2g} of the others' "
            f"(limit {factor:g}x)")


def _bans(meta: Any) -> set[str]:
    listed = meta.get("bans") if isinstance(meta, dict) else None
    if not isinstance(listed, list):
        return set()
    return {p for p in listed[:MAX_BANS] if isinstance(p, str)}


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a gathered value (lists become tuples)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value
