"""One outer round of one learner, as an object with explicit stages.

    PREPARED  → Δ = Θ − θ computed, its norm and weight (tokens since the last merge) known
    AVERAGING → matchmaking and all-reduce with a group at the same version (network); contributions that
                fail the group's checks (p2p_diloco/core/exclusion.py) are left out of the average
    VALIDATED → contributors held our exact global state; averaged Δ finite and of sane norm
    APPLIED   → outer Nesterov step on Θ, version + 1, certified: at least K contributors signed the
                new state (p2p_diloco/trust/certificates.py); without the certificate nothing is committed
    FAILED    → nothing was committed; the learner keeps its θ and its Δ grows until a later round

A failure anywhere is contained here: the learner's training loop sees a :class:`RoundOutcome`,
never an exception from the network.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from p2p_diloco.core import shard_sketches
from p2p_diloco.core.averaging_api import Averaging, RoundFailed, RoundSuperseded
from p2p_diloco.core.exclusion import Verdict, count
from p2p_diloco.core.merging import global_norm, rda_combine, to_unit
from p2p_diloco.core.outer import GlobalState, OuterOptimizer, pseudo_gradient, round_span, round_work
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.trust.certificates import Certifier, Commit

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    """The stages of an :class:`OuterRound`, as in the module docstring."""
    PREPARED = "prepared"
    AVERAGING = "averaging"
    VALIDATED = "validated"
    APPLIED = "applied"
    FAILED = "failed"


@dataclass
class RoundOutcome:
    """How a round ended: its last stage, why it failed (``reason``), its group (``group_size``: the contributors,
    without members whose contributions were excluded), seconds, bytes sent, and the fragment's version afterwards.
    """
    stage: Stage
    reason: str = ""
    group_size: int = 0
    group_tokens: int = 0
    allreduce_seconds: float = 0.0
    round_seconds: float = 0.0
    bytes_sent: int = 0
    certify_seconds: float = 0.0  # collecting the commit certificate's signatures
    version: int = 0
    superseded: bool = False  # the swarm moved past our version while we looked for a group
    parent: str = ""  # committed: the hash of the state the round was applied to
    sha256: str = ""  # committed: the new state's hash
    members: dict[str, dict[str, Any]] = field(default_factory=dict)  # committed: contributor → its tokens, weight
    excluded: dict[str, str] = field(default_factory=dict)  # groupmate → why its contribution was left out

    @property
    def committed(self) -> bool:
        """Whether the outer step was applied."""
        return self.stage is Stage.APPLIED


@dataclass
class OuterRound:
    """One fragment's round. ``state`` and ``local_params`` are that fragment's tensors only."""

    state: GlobalState
    optimizer: OuterOptimizer
    averaging: Averaging
    local_params: list[torch.Tensor]
    tokens: int
    inner_steps: int
    lr_steps: float | None = None  # the inner steps, each as (its lr / the peak lr)² (None: not gathered)
    max_delta_norm: float = 1e4
    weight: float | None = None  # default: tokens
    fragment: int = 0
    rda: bool = False
    grace: float | None = None
    search_seconds: float | None = None  # how long to look for a group at most (None: averaging.round_timeout)
    certifier: Certifier | None = None  # None: commits carry no certificate (tests of the round alone)
    verify_reducers: bool = True  # check the shards against the senders' sketches before signing
    steps_per_outer: int | None = None  # H: a round of fewer steps is a share of an outer step (None: always whole)
    faults: FaultHooks = NO_FAULTS  # test-only fault injection (poison, lie with weight)
    stage: Stage = field(init=False, default=Stage.PREPARED)
    _delta: list[torch.Tensor] = field(init=False, repr=False)
    _norm: float = field(init=False, default=0.0)
    _excluded: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._delta = pseudo_gradient(self.state.params, self.local_params)
        self._delta = self.faults.outer_gradient(self._delta, self.state.version + 1)
        if self.weight is None:
            self.weight = float(self.tokens)
        self.weight = self.faults.gathered_weight(self.weight, self.state.version + 1)
        if self.rda:
            self._delta, self._norm = to_unit(self._delta)
        else:
            self._norm = global_norm(self._delta)

    def metadata(self) -> dict[str, Any]:
        """What this learner gathers to its group: version and hash of the state it holds, tokens, inner steps,
        weight, Δ's global L2 norm (fp64) and whether Δ is finite, whether it sends Δ/‖Δ‖ (RDA), and the inner
        steps at the peak lr (``lr_steps``, when known). Groupmates must agree on version and hash; the norms per
        step decide who is left out (:mod:`p2p_diloco.core.exclusion`).
        """
        meta = {
            "version": self.state.version,
            "sha256": self.state.sha256(),
            "tokens": int(self.tokens),
            "steps": int(self.inner_steps),
            "weight": float(self.weight or 0.0),
            "norm": float(self._norm),
            "finite": math.isfinite(self._norm),
            "unit": bool(self.rda),
        }
        if self.lr_steps is not None:
            meta["lr_steps"] = float(self.lr_steps)
        return meta

    def run(self) -> RoundOutcome:
        """Run the round to an outcome. Never raises: an unexpected error is latched into a failed
        outcome (one WARNING line, the traceback at DEBUG), so the training loop never unwinds."""
        started = time.perf_counter()
        try:
            outcome = self._run()
        except (Exception, asyncio.CancelledError) as e:  # contained in the round, by design
            logger.warning(f"round of fragment {self.fragment} failed unexpectedly: {type(e).__name__}: {e}")
            logger.debug("the round's traceback", exc_info=True)
            outcome = self._fail(f"unexpected {type(e).__name__}: {e}")
        outcome.round_seconds = time.perf_counter() - started
        outcome.version = self.state.version
        outcome.excluded = self._excluded
        return outcome

    def _run(self) -> RoundOutcome:
        if self.tokens <= 0 or not self.weight or self.weight <= 0:
            return self._fail("no local progress to contribute")
        meta = self.metadata()
        self.stage = Stage.AVERAGING
        try:
            result = self.averaging.average(
                self._delta, float(self.weight), meta, self.state.version, fragment=self.fragment, grace=self.grace,
                search_seconds=self.search_seconds, standing=self.state.standing,
            )
        except RoundSuperseded as e:
            outcome = self._fail(str(e))
            outcome.superseded = True
            return outcome
        except RoundFailed as e:
            return self._fail(str(e))
        self._log_exclusions(result.verdict)
        contributors = result.contributors
        mates = {p: result.groupmates[p] for p in contributors}
        problem = self._check_group(mates, meta) if mates else "every contribution was excluded"
        averaged = result.deltas
        if not problem and self.rda:
            norms = [mates[p]["norm"] * result.verdict.scale(p) for p in contributors]
            averaged = rda_combine(averaged, norms, [self._weight(result.verdict, p, mates) for p in contributors])
        problem = problem or self._check_delta(averaged)
        if problem:
            return self._fail(problem, group_size=len(contributors))
        self.stage = Stage.VALIDATED
        group_tokens = sum(int(m.get("tokens", 0)) for m in mates.values())
        work, span = 1.0, 1.0
        if self.steps_per_outer is not None:
            steps = [(self._weight(result.verdict, p, mates), count(m.get("steps"))) for p, m in sorted(mates.items())]
            work = round_work(steps, self.steps_per_outer)
            span = round_span((s for _, s in steps), self.steps_per_outer)
        # Their standing (p2p_diloco/core/standing.py) is part of the new state's hash: credited before the step,
        # which remembers that hash in the state's history (a history entry without the credit made descendants
        # look like siblings: spurious split-brain merges).
        self.state.credit(contributors)
        self.optimizer.apply(self.state, averaged, tokens=group_tokens, work=work, span=span)
        self.state.record_contributors(self.state.version, contributors)
        new_sha = self.state.sha256()
        certifying = time.perf_counter()
        if self.certifier is not None:
            commit = Commit(self.certifier.lineage, self.fragment, self.state.version,
                            self.faults.signed_sha(new_sha, self.state.version), meta["sha256"],
                            tuple(sorted(contributors)))
            if self.verify_reducers and result.sketch is not None and result.sketch_key:
                cert = self.certifier.certify(commit, sketch=result.sketch, sketch_key=result.sketch_key,
                                              verify=self._reducers_checker(result.sketch, result.verdict, mates),
                                              patience=result.allreduce_seconds)
            else:
                cert = self.certifier.certify(commit, patience=result.allreduce_seconds)
            if isinstance(cert, str):
                self._blame(getattr(cert, "blamed", ()), cert)
                return self._fail(cert, group_size=len(contributors))
            self.state.add_certificate(self.state.version, cert.to_dict())
        self.stage = Stage.APPLIED
        return RoundOutcome(
            stage=self.stage,
            group_size=len(contributors),
            group_tokens=group_tokens,
            allreduce_seconds=result.allreduce_seconds,
            bytes_sent=result.bytes_sent,
            certify_seconds=time.perf_counter() - certifying,
            parent=meta["sha256"],
            sha256=new_sha,
            members={p: {"tokens": int(m.get("tokens", 0)), "weight": self._weight(result.verdict, p, mates)}
                     for p, m in mates.items()},
        )

    def _log_exclusions(self, verdict: Verdict) -> None:
        """One line per excluded groupmate: WARNING for what it sent, INFO when only its groupmates' bans exclude it."""
        for peer, exclusion in sorted(verdict.excluded.items()):
            self._excluded[peer] = exclusion.why
            logger.log(logging.INFO if exclusion.banned else logging.WARNING,
                       f"excluded {peer[-6:]} from fragment {self.fragment} version {self.state.version}: "
                       f"{exclusion.why}")

    def _reducers_checker(self, mine: dict[str, Any], verdict: Verdict, mates: dict[str, dict[str, Any]]):
        """``verify`` for the commit board: do the shards we received match what their senders sketched?"""
        weights = {p: self._weight(verdict, p, mates) for p in mates}
        # A bound on each sender's whole part as its reducers saw it (unit vectors, or clipped Δ, plus rounding).
        norms = {p: 1.1 * (1.0 if p in verdict.unit else float(mates[p]["norm"]) * verdict.scale(p)) for p in mates}

        def verify(sketches: dict[str, Any]) -> str:
            why, reducer = shard_sketches.first_mismatch(mine, sketches, weights, norms)
            if why:
                logger.warning(f"fragment {self.fragment} version {self.state.version}: not signing the round: {why}")
            accuse = getattr(self.averaging, "accuse", None)
            if reducer is not None and accuse is not None:
                accuse(reducer, "its shard did not match what its senders sent")
            return why

        return verify

    def _blame(self, peers: Sequence[str], why: str) -> None:
        """Ban the members a failed commit names from this learner's next rounds (a failure has an owner: the
        groupmates that ban it too leave it out of their rounds, :class:`p2p_diloco.core.bans.Bans`)."""
        accuse = getattr(self.averaging, "accuse", None)
        for peer in peers:
            self._excluded[peer] = why
            if accuse is not None:
                accuse(peer, why)

    @staticmethod
    def _weight(verdict: Verdict, peer: str, mates: dict[str, dict[str, Any]]) -> float:
        """The weight ``peer`` counted with: the verdict's, bounded by its metadata, not the one it claimed."""
        return verdict.weights.get(peer, float(mates[peer].get("weight", 1.0)))

    def _fail(self, reason: str, group_size: int = 0) -> RoundOutcome:
        self.stage = Stage.FAILED
        return RoundOutcome(stage=self.stage, reason=reason, group_size=group_size)

    @staticmethod
    def _check_group(groupmates: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
        for peer, theirs in groupmates.items():
            if not isinstance(theirs, dict):
                return f"groupmate {peer} sent malformed metadata"
            if theirs.get("version") != meta["version"] or theirs.get("sha256") != meta["sha256"]:
                return (
                    f"groupmate {peer} holds version {theirs.get('version')} "
                    f"sha {str(theirs.get('sha256'))[:12]}, we hold {meta['version']} {meta['sha256'][:12]}"
                )
            tokens = theirs.get("tokens")
            if not isinstance(tokens, int) or tokens < 0:
                return f"groupmate {peer} reported invalid tokens {tokens!r}"
            for key in ("weight", "norm"):
                value = theirs.get(key)
                if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                    return f"groupmate {peer} reported invalid {key} {value!r}"
        return ""

    def _check_delta(self, deltas: list[torch.Tensor]) -> str:
        if len(deltas) != len(self.state.params):
            return f"averaged {len(deltas)} tensors, expected {len(self.state.params)}"
        norm_sq = 0.0
        for d, p in zip(deltas, self.state.params, strict=True):
            if d.shape != p.shape or d.dtype != torch.float32:
                return f"averaged tensor {tuple(d.shape)} {d.dtype} does not match {tuple(p.shape)}"
            if not torch.isfinite(d).all():
                return "averaged outer gradient is not finite"
            norm_sq += float(d.double().pow(2).sum())
        if norm_sq**0.5 > self.max_delta_norm:
            return f"averaged outer gradient norm {norm_sq ** 0.5:.3g} exceeds {self.max_delta_norm:g}"
        return ""
