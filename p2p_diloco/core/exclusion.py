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
2. **Outlier.** With ``norm_outlier_factor`` f > 0: a member whose norm per square root of its inner steps
   (``norm / √steps``) is above f times the median of the *other* valid members' is excluded. Norms are
   compared for the steps behind them because an honest learner that missed rounds sends many steps'
   progress at once, and one that just (re)joined sends few; by the square root because an outer gradient of
   Adam steps grows like a random walk, not like a straight line: per inner step, a learner restarted from
   nothing that met a round after 1 step, beside others sending 80, was 8-9x their median and left out
   (chaos benchmark); per √step it is 1.0x (docs/security.md, "Honest outliers"). And each step
   counts as much as its lr allows: a member gathers ``lr_steps``, the sum of (lr / peak lr)² over its
   steps, so that under a warm-up or a cosine decay a contribution of many steps at a high lr is not an
   outlier beside ones of a few steps at a low lr (CI: 20 warm-up steps beside 1-2 at the
   warm-up's start were 22x per √step). ``lr_steps`` is bounded by the steps, and by the warm-up as the
   group's version allows (:func:`_peak_steps`). Leave-one-out, so that an outlier cannot raise its own
   yardstick, and so that the rule means something in tiny groups: alone, nobody is compared (only rule 1
   applies); in a pair, the larger norm is excluded when it is more than f times the smaller one (with the
   plain median of two, their mean, no norm can ever be f ≥ 2 times the median, so a pair would never
   exclude anyone); from three members on it is the median of the others (with two others, their mean). A
   norm equal to f times the median stays in. In a pair the rule bets on the smaller norm: the failures seen
   in practice (diverging training, exploding updates, NaN) make norms larger, and a stalled learner's small
   outer gradient does little harm when averaged in.
3. **Direction.** With ``direction_check`` on, every member gathers a count sketch of its outer gradient
   (``direction``, :mod:`p2p_diloco.core.directions`); from three members with a sketch on, a member whose
   outer gradient points away from a strict majority of the others' (a learner that climbs the loss) is
   excluded. A member that gathers no valid sketch while the rule is on is excluded as malformed.
4. **Banned.** Each member publishes the peers *it* excluded under rules 1-3 in its recent
   rounds (``bans``, kept by :class:`~p2p_diloco.core.bans.Bans`). A member is excluded when a strict majority of the
   other members that passed rules 1-3 list it. Only those members vote, so a broken or outlying
   member cannot ban anyone, and a single member cannot ban an honest majority away.

A member that gathered no ``weight`` counts with hivemind's default weight 1.0; one that gathered
no ``norm`` is not compared (our learners always gather both: the averaging layer sees to it).
``tokens`` and ``steps``, when gathered, must be integers from 0 to 2⁶³−1 (no bool, no float), and
``lr_steps`` a non-negative finite number, else the member is excluded as malformed (rule 1).

Bounded weights: with ``max_steps`` S in the rules, a member's weight is never more than its metadata
allows. T, the most tokens one inner step may hold, is the rules' ``tokens_per_step``
(``averaging.max_tokens_per_step``, one value for the whole swarm) or, without it, the lower median of
the ``step_tokens`` the valid members gathered (batch · seq_len · workers of each): an honest majority
sets it, a liar cannot raise it, and learners with different batches still meet (a member above the
median counts as the median, logged). Its steps count as s = min(steps, S) (S when it gathered none),
its tokens as t = min(tokens, s·T) (s·T when it gathered none), and its weight is
``min(claimed, token_weight(t, s, 0, weighting))``. The claimed weight of an honest learner is
``token_weight(tokens, steps, missed_versions, weighting)`` with tokens ≤ steps·T and the staleness
divisor 1 + missed_versions ≥ 1, so it never exceeds the bound and is used unchanged; a claim above
the bound counts as the bound, so lying gains at most the weight of S honest steps. Staleness need
not be gathered: a member can only lower its own weight with it. The outlier rule divides norms by
√s too, so that claiming 2⁶³ steps hides no norm. A member whose weight is cut down, or whose tokens
exceed its steps·T, is kept (clamped, not excluded: a learner unit with more workers than T allows,
or one absent for many rounds, still brings real progress) and logged once per round at WARNING.

Clipping: with ``max_contribution_norm`` c, a contribution of norm n > c is scaled by c / n
before it is averaged (reducers scale its parts; for radial-directional averaging, whose parts
are unit vectors, the round scales its norm instead).

Aggregation: ``aggregator`` (:mod:`p2p_diloco.core.aggregators`) is how each reducer combines the
contributions that are left: the token-weighted mean, or a coordinate-wise median or trimmed mean
that ignores the self-reported weights.

The thresholds themselves must be the same at every member, or members would disagree: each
member gathers its :class:`Rules`; :func:`group_rules` takes those of a strict majority and leaves the
others out (a pair that differs fails its round).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from p2p_diloco.core import directions
from p2p_diloco.core.aggregators import AGGREGATORS
from p2p_diloco.core.merging import token_weight

logger = logging.getLogger(__name__)

MAX_BANS = 64  # entries of a groupmate's ban list that are read (a list can be no reason to allocate)
# A contribution counts at most this many times H inner steps. An honest learner in phase brings H
# steps (up to 2H−1 in the round after the schedule re-phased it); one whose rounds failed or that
# missed versions brings more, and keeps its work but counts as 2H. With the mean aggregator a liar's
# weight is then at most twice an honest in-phase learner's: three honest learners outweigh it.
MAX_STEPS_FACTOR = 2
MAX_COUNT = 2**63 - 1  # tokens and steps above it fit no signed 64-bit field: malformed
MIN_LR_SHARE = 1e-6  # the least a step counts as at the peak lr in the outlier rule: (a thousandth of it)²
WEIGHTINGS = ("tokens", "tokens2_per_step")


class RulesDisagree(ValueError):
    """Members of one group gathered different robust-merging rules: nobody may commit the round."""


@dataclass(frozen=True)
class Rules:
    """The robust-merging rules (``averaging.norm_outlier_factor``, ``averaging.max_contribution_norm``,
    ``averaging.aggregator``) and what bounds a contribution's weight: ``tokens_per_step`` (the most
    tokens an inner step holds), ``max_steps`` (:data:`MAX_STEPS_FACTOR` · H, :meth:`bounded_by`) and ``weighting``
    (``sync.weighting``). Without ``tokens_per_step`` and ``max_steps`` claimed weights are not bounded."""

    norm_outlier_factor: float = 8.0  # 0 disables the outlier rule
    max_contribution_norm: float | None = None  # None: no clipping
    aggregator: str = "mean"  # how reducers combine contributions (p2p_diloco/core/aggregators.py)
    tokens_per_step: int | None = None
    max_steps: int | None = None
    weighting: str = "tokens2_per_step"
    warmup_steps: int = 0  # the inner lr's warm-up W (``inner.warmup_steps``): bounds a member's ``lr_steps``
    direction_check: bool = False  # rule 3 (``averaging.direction_check``)

    def bounded_by(self, tokens_per_step: int | None, steps_per_outer: int, weighting: str,
                   warmup_steps: int = 0) -> Rules:
        """These rules, bounding weights for learners of ``tokens_per_step`` and H = ``steps_per_outer``, and
        their ``lr_steps`` by the inner lr's warm-up of ``warmup_steps``.

        >>> Rules(4.0).bounded_by(1024, 20, "tokens").max_steps
        40
        """
        return replace(self, tokens_per_step=tokens_per_step, max_steps=MAX_STEPS_FACTOR * steps_per_outer,
                       weighting=weighting, warmup_steps=warmup_steps)

    def gathered(self) -> list[float | int | str | None]:
        """The form a member gathers to its group."""
        return [float(self.norm_outlier_factor), self.max_contribution_norm, self.aggregator,
                self.tokens_per_step, self.max_steps, self.weighting, self.warmup_steps, self.direction_check]

    def peak_share(self, version: int) -> float:
        """The largest (lr / peak lr)² an honest step on ``version`` can have taken: a learner's lr follows the
        global version (position version · H + steps on it, at most H: lr_schedule.py), so under a warm-up of W
        steps no step on ``version`` or before it ran above the lr at position (version + 1) · H. 1 without a
        warm-up or without H (``max_steps``).

        >>> round(Rules(8.0).bounded_by(None, 20, "tokens", warmup_steps=100).peak_share(0), 4)
        0.0441
        """
        if not self.warmup_steps or self.max_steps is None:
            return 1.0
        steps_per_outer = self.max_steps // MAX_STEPS_FACTOR
        return min(1.0, ((version + 1) * steps_per_outer + 1) / self.warmup_steps) ** 2


def agreed_rules(gathered: Mapping[str, Any], default: Rules) -> Rules:
    """The rules every member gathered (under ``"rules"``), or ``default`` when none gathered any.

    Raises :class:`RulesDisagree` when members gathered different or malformed rules.

    >>> rules = [4.0, None, "median", 1024, 40, "tokens2_per_step", 0, True]
    >>> agreed_rules({"a": {"rules": rules}, "b": {"rules": rules}}, Rules()).max_steps
    40
    """
    rules, dissent = group_rules(gathered, default)
    if dissent:
        raise RulesDisagree(f"groupmates gathered different robust-merging rules: {sorted(dissent)}")
    return rules


def group_rules(gathered: Mapping[str, Any], default: Rules) -> tuple[Rules, dict[str, str]]:
    """The rules a strict majority of the members gathered, and the members that gathered others, with why.

    A member whose rules differ from the majority's is left out of the round (:func:`judge`'s ``dissent``) and
    banned like any member whose gathered metadata shows a fault: it signed them, so every member can check
    it, and one member can no longer fail every round it joins by gathering rules of its own. Without a strict
    majority (a pair that differs), nobody can tell who is wrong: :class:`RulesDisagree` fails the round.

    >>> ours = [4.0, None, "mean", None, None, "tokens", 0, True]
    >>> theirs = [9.0, *ours[1:]]
    >>> rules, dissent = group_rules({"a": {"rules": ours}, "b": {"rules": ours}, "c": {"rules": theirs}}, Rules())
    >>> rules.norm_outlier_factor, sorted(dissent)
    (4.0, ['c'])
    """
    frozen = {p: _frozen(m.get("rules") if isinstance(m, dict) else None) for p, m in gathered.items()}
    counts = collections.Counter(frozen.values())
    seen = set(counts)
    if len(seen) > 1:
        value, held = max(counts.items(), key=lambda vc: vc[1])
        if 2 * held <= len(frozen):
            raise RulesDisagree(f"groupmates gathered different robust-merging rules: {sorted(map(str, seen))}")
        dissent = {p: f"it gathered other robust-merging rules than the group's majority: {str(v)[:120]}"
                   for p, v in frozen.items() if v != value}
        return _parsed_rules(value, default), dissent
    (only,) = seen or {None}
    return _parsed_rules(only, default), {}


def _parsed_rules(only: Any, default: Rules) -> Rules:
    """Gathered rules (frozen) as :class:`Rules`; ``default`` for None; :class:`RulesDisagree` when malformed."""
    if only is None:
        return default
    if (not isinstance(only, tuple) or len(only) != 8 or only[2] not in AGGREGATORS or only[5] not in WEIGHTINGS
            or not isinstance(only[7], bool)):
        raise RulesDisagree(f"malformed robust-merging rules {only!r}")
    factor, cap = _number(only[0]), None if only[1] is None else _number(only[1])
    tokens_per_step, max_steps, warmup_steps = only[3], only[4], only[6]
    if (factor is None or (only[1] is not None and (cap is None or cap <= 0))
            or (tokens_per_step is not None and max_steps is None)
            or (max_steps is not None and not count(max_steps))
            or (tokens_per_step is not None and not count(tokens_per_step))
            or count(warmup_steps) is None):
        raise RulesDisagree(f"malformed robust-merging rules {only!r}")
    return Rules(factor, cap, str(only[2]), tokens_per_step, max_steps, str(only[5]), warmup_steps, only[7])


@dataclass(frozen=True)
class Exclusion:
    """Why one member's contribution is left out; ``banned``: only because groupmates ban it; ``evidence``: what
    it gathered shows the fault (False for metadata that does not carry its signature: the leader that relays
    it may have changed it, so the member is left out of this round but nobody bans it for that)."""

    why: str
    banned: bool = False
    evidence: bool = True


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge` decided for one round.

    ``excluded``: peer → :class:`Exclusion`; ``weights``: each contributor's weight, from its gathered
    metadata and bounded by the rules; ``scales``: each contributor's clipping factor (1.0: not clipped);
    ``unit``: the contributors whose parts are unit vectors (radial-directional averaging); ``bounded``:
    contributor → why its claimed weight or tokens were cut down to what its steps allow.
    """

    excluded: dict[str, Exclusion] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    scales: dict[str, float] = field(default_factory=dict)
    unit: frozenset[str] = frozenset()
    aggregator: str = "mean"  # the rules' aggregator: how reducers combine the contributions
    bounded: dict[str, str] = field(default_factory=dict)

    def contributors(self, peers: Iterable[str]) -> list[str]:
        """``peers`` that are not excluded, sorted."""
        return sorted(p for p in peers if p not in self.excluded)

    def scale(self, peer: str) -> float:
        """The factor ``peer``'s outer gradient is clipped by (1.0 when it is not)."""
        return self.scales.get(peer, 1.0)

    def part_scale(self, peer: str) -> float:
        """The factor a reducer multiplies ``peer``'s parts by: its clip, unless its parts are unit vectors."""
        return 1.0 if peer in self.unit else self.scale(peer)


def judge(gathered: Mapping[str, Any], rules: Rules, forged: Mapping[str, str] | None = None,
          dissent: Mapping[str, str] | None = None, ramp: Mapping[str, float] | None = None) -> Verdict:
    """Apply the module's rule to a group's gathered metadata (peer id → dict). ``forged``: the members
    whose metadata does not carry their own signature (:mod:`p2p_diloco.trust.signed_metadata`), with why;
    they are excluded before anything they said counts (and not banned). ``dissent``: the members that gathered
    other rules than the group's (:func:`group_rules`), with why; excluded and banned. ``ramp``: the share of its
    bounded weight each member counts with (:func:`p2p_diloco.core.standing.ramp`: a fresh identity's is small;
    absent: 1).

    >>> meta = lambda n: {"norm": n, "finite": True, "weight": 1.0}
    >>> v = judge({"a": meta(1.0), "b": meta(1.2), "c": meta(100.0), "d": meta(float("nan"))}, Rules(8.0))
    >>> sorted(v.excluded), v.excluded["d"].why
    (['c', 'd'], 'its outer gradient is not finite')
    """
    excluded: dict[str, Exclusion] = {}
    weights: dict[str, float] = {}
    norms: dict[str, float] = {}
    steps: dict[str, float] = {}  # inner steps at the peak lr (:func:`_peak_steps`)
    bounded: dict[str, str] = {}
    source = "averaging.max_tokens_per_step" if rules.tokens_per_step is not None else "the group's lower median"
    rules = _with_step_tokens(gathered, rules)
    for peer in sorted(gathered):
        meta = gathered[peer]
        if forgery := (forged or {}).get(peer):
            excluded[peer] = Exclusion(forgery, evidence=False)
            continue
        if why := (dissent or {}).get(peer) or _broken(meta):
            excluded[peer] = Exclusion(why)
            continue
        weight = _number(meta.get("weight", 1.0))
        assert weight is not None  # checked by _broken
        weights[peer], bounded_why = _bounded_weight(meta, weight, rules, source)
        weights[peer] *= (ramp or {}).get(peer, 1.0)
        if bounded_why:
            bounded[peer] = bounded_why
        if meta.get("norm") is not None:
            norms[peer] = _number(meta["norm"]) or 0.0
            steps[peer] = _peak_steps(meta, rules)
    if rules.norm_outlier_factor > 0:
        # Per √step at the peak lr: honest learners send the progress of few or many steps, which grows like a
        # random walk of steps each as long as its lr.
        rates = {p: n / math.sqrt(steps[p]) for p, n in norms.items()}  # steps[p] > 0: _peak_steps
        if logger.isEnabledFor(logging.DEBUG):  # judged every round: no string built when nobody reads it
            logger.debug("norms per √(inner steps at the peak lr): " + ", ".join(
                f"{p[-6:]} {rates[p]:.3g} ({steps[p]:.3g} steps)" for p in sorted(rates)))
        for peer, rate in rates.items():
            others = [r for q, r in rates.items() if q != peer]
            if others and rate > rules.norm_outlier_factor * (median := statistics.median(others)):
                excluded[peer] = Exclusion(_outlier(rate, median, rules.norm_outlier_factor))
    if rules.direction_check:
        excluded.update(_directions(gathered, [p for p in sorted(weights) if p not in excluded]))
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
    bounded = {p: why for p, why in bounded.items() if p not in excluded}
    for peer, why in bounded.items():
        logger.warning(f"bounded the weight of {peer[-6:]}: {why}")
    return Verdict(excluded, {p: w for p, w in weights.items() if p not in excluded}, scales, unit, rules.aggregator,
                   bounded)


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
    for key in ("tokens", "steps"):
        if key in meta and count(meta[key]) is None:
            return f"its {key} {meta[key]!r} are invalid"
    if "lr_steps" in meta and _number(meta["lr_steps"]) is None:
        return f"its lr_steps {meta['lr_steps']!r} are invalid"
    return ""


def count(value: Any) -> int | None:
    """``value`` as a token or step count (an int from 0 to :data:`MAX_COUNT`, not a bool), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        return None
    return value


def _with_step_tokens(gathered: Mapping[str, Any], rules: Rules) -> Rules:
    """``rules`` with T: their own, else the lower median of the valid ``step_tokens`` members gathered."""
    if rules.tokens_per_step is not None or rules.max_steps is None:
        return rules
    told = sorted(n for m in gathered.values() if isinstance(m, dict) and not _broken(m)
                  and (n := count(m.get("step_tokens"))))
    return replace(rules, tokens_per_step=told[(len(told) - 1) // 2]) if told else rules


def _bounded_weight(meta: Mapping[str, Any], claimed: float, rules: Rules, source: str) -> tuple[float, str]:
    """The weight a valid member counts with under ``rules``, and why it was cut down ("" when it was not)."""
    per_step, max_steps = rules.tokens_per_step, rules.max_steps
    if per_step is None or max_steps is None:
        return claimed, ""
    steps, tokens = meta.get("steps"), meta.get("tokens")  # valid counts or absent: checked by _broken
    counted_steps = max_steps if steps is None else min(steps, max_steps)
    allowed = counted_steps * per_step
    counted_tokens = allowed if tokens is None else min(tokens, allowed)
    bound = token_weight(counted_tokens, counted_steps, 0, rules.weighting)
    # Reported: a weight cut down, or more tokens than its own steps hold (beyond S steps is no lie).
    if claimed <= bound and (tokens is None or tokens <= (max_steps if steps is None else steps) * per_step):
        return claimed, ""
    return min(claimed, bound), (f"it claimed weight {claimed:.4g} for {tokens} tokens in {steps} inner steps; "
                                 f"counted as {counted_tokens} tokens in {counted_steps} steps, weight "
                                 f"{min(claimed, bound):.4g} (at most {per_step} tokens a step: "
                                 f"{source}; {max_steps} steps: {MAX_STEPS_FACTOR}·H)")


def _steps(meta: Mapping[str, Any]) -> int:
    """The inner steps behind a contribution (at least 1; a missing or bad count counts as 1)."""
    steps = meta.get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else 1


def _peak_steps(meta: Mapping[str, Any], rules: Rules) -> float:
    """What the steps behind a valid member's contribution count as in the outlier rule: its ``lr_steps``, the sum
    of (lr / peak lr)² over them, bounded by its steps s (at most S = ``max_steps``) times the largest share
    :meth:`Rules.peak_share` allows at its version; s · that share when it gathered no ``lr_steps``.

    A step moves the weights by about its lr, so under a warm-up or a decay the norms of honest contributions
    differ with the lr their steps ran at, not only with how many there were. Claiming more than the bound gains
    nothing; claiming less only makes the member's own norm look larger."""
    counted = _steps(meta) if rules.max_steps is None else min(_steps(meta), rules.max_steps)
    version = count(meta.get("version"))
    bound = counted * rules.peak_share(version if version is not None else 0)
    claimed = meta.get("lr_steps")
    # At least a millionth of a peak step per step: a claimed 0 would divide by zero.
    return bound if claimed is None else max(MIN_LR_SHARE * counted, min(float(claimed), bound))


def _directions(gathered: Mapping[str, Any], members: list[str]) -> dict[str, Exclusion]:
    """Rule 3 over the valid ``members``: a malformed sketch, or one that disagrees with most of the others'."""
    out, sketches = {}, {}
    for peer in members:
        sketch = directions.valid(gathered[peer].get("direction"))
        if sketch is None:
            out[peer] = Exclusion("its direction sketch is missing or malformed")
        else:
            sketches[peer] = sketch
    if logger.isEnabledFor(logging.DEBUG) and len(sketches) > 1:
        logger.debug("cosines of the outer gradients' sketches: " + "; ".join(
            f"{p[-6:]} {' '.join(f'{c:+.2f}' for c in cs)}" for p, cs in sorted(directions.cosines(sketches).items())))
    out.update({p: Exclusion(why) for p, why in directions.disagreeing(sketches).items()})
    return out


def _outlier(rate: float, median: float, factor: float) -> str:
    if median == 0:
        return f"norm per √(inner steps at the peak lr) {rate:.2g} while the others' median is 0"
    return (f"norm per √(inner steps at the peak lr) {rate:.2g} is {rate / median:.0f}x the median {median:.2g} of "
            f"the others' (limit {factor:g}x)")


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
