"""The DiLoCo outer step, free of networking.

Global state = (Θ, outer-optimizer momentum, version). A learner runs H inner steps from Θ and
reaches θ; its outer gradient (pseudo-gradient) is Δ = Θ − θ. The swarm averages Δ weighted by the
tokens behind it, and every member applies the same Nesterov-SGD step to its fp32 copy of Θ::

    b ← μ·b + Δ̄            (b = Δ̄ on the very first step, like torch.optim.SGD)
    Θ ← Θ − lr·(Δ̄ + μ·b)    (Nesterov; plain momentum uses Θ ← Θ − lr·b)

A round whose contributions carry fewer than H inner steps (a learner's parting round, a fragment's
first round after a restart) is a share w < 1 of an outer step (:func:`round_work`: the mean of the
steps over H, weighted as the round averaged). With ``outer.short_rounds = "scaled"`` (the default) it
moves the momentum and its look-ahead by that share::

    b ← (1 − w·(1 − μ))·b + Δ̄
    Θ ← Θ − lr·(Δ̄ + w·μ·b)  (Nesterov; plain momentum: Θ ← Θ − lr·(Δ̄ + w·(b − Δ̄)))

which is the step above at w = 1 and no step at all (b and Θ unchanged) as w and Δ̄ go to 0. Without it a
round of a handful of steps still moved Θ by lr·μ²·b, about 80% of a full step, on momentum alone
(docs/design.md, "Short rounds").

A round whose contributions carry s > H inner steps, s the lower median of their steps (a slow link's
long period, the round after a failed one), spans r = s/H > 1 outer steps' time (:func:`round_span`,
at most :data:`MAX_SPAN`). With ``outer.long_rounds = "decayed"`` (the default) the momentum that goes on past it
is μʳ instead of μ, in the decay of b and in the look-ahead alike (μ replaced by μʳ above)::

    b ← μʳ·b + Δ̄
    Θ ← Θ − lr·(Δ̄ + μʳ·b)

An outer gradient of many inner steps has already moved most of the way its modes can go; the old
momentum pushed on along the last rounds' directions and overshot (docs/design.md, "Long rounds").
μʳ is :func:`decayed_momentum`: products of μ for the whole part of r, linear in its fraction. Only
products and sums of the exact ints and floats every member holds: no ``pow``, whose last bit may
differ between C libraries.

The update is a fixed sequence of fp32 CPU tensor operations, so learners that start from
bit-identical state and apply bit-identical Δ̄ end bit-identical: that is what lets one hash stand
for the global state across the swarm.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.core import standing as standings

HISTORY_LENGTH = 512
CONTRIBUTOR_VERSIONS = 32  # versions whose contributors a state remembers (see GlobalState.contributors)
CERTIFIED_VERSIONS = 8  # versions whose commit certificates a state carries (p2p_diloco/trust/certificates.py)
MAX_VERSION = 2**40  # a version or token count beyond these is a peer's lie, not progress
MAX_TOKENS = 2**62  # below msgpack's 64-bit limit with room to add a round's tokens

ApplyPolicy = Literal["overwrite", "mix"]


class StateFormatError(ValueError):
    """A serialised global state (from a peer or a checkpoint) is malformed."""


@dataclass
class GlobalState:
    """Θ (fp32, CPU), the outer momentum buffers and the version (number of outer steps applied)."""

    params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    version: int = 0
    momentum_initialized: bool = False
    tokens: int = 0  # tokens merged into this lineage so far, summed over all learners
    # (version, sha256) of the states this one descends from, newest last: tells a descendant
    # (catch up) from a sibling lineage (split brain: merge). Not part of the hash.
    history: list[tuple[int, str]] = field(default_factory=list)
    # (version, peer ids) for the newest versions: whose outer gradients the round that produced that
    # version averaged. A learner whose own round failed, or that was killed, while the others
    # committed, reads here whether its progress is already in Θ (docs/resilience.md,
    # "Exactly-once contributions"). Not part of the hash.
    contributors: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    # The commit certificates of the newest versions, as served (Certificate.to_dict()): what lets a
    # peer that downloads this state check that a quorum committed it (p2p_diloco/trust/certificates.py).
    # Opaque here, checked where they are used. Not part of the hash.
    certificates: list[dict[str, Any]] = field(default_factory=list)
    # Peer → how many committed versions of this state's fragment it contributed to
    # (p2p_diloco/core/standing.py: who is established). Part of the hash.
    standing: dict[str, int] = field(default_factory=dict)

    def credit(self, contributors: Iterable[str]) -> None:
        """Credit ``contributors`` with the version this state just reached (before its hash is taken)."""
        self.standing = standings.credited(self.standing, contributors)

    def add_certificate(self, version: int, certificate: dict[str, Any]) -> None:
        """Carry ``certificate`` as the one of ``version``; only the newest :data:`CERTIFIED_VERSIONS` are kept."""
        entries = {_cert_version(c): c for c in self.certificates}
        entries[int(version)] = certificate
        self.certificates = [entries[v] for v in sorted(entries)][-CERTIFIED_VERSIONS:]

    def record_contributors(self, version: int, peers: Iterable[str]) -> None:
        """Record whose outer gradients produced ``version`` (replacing an earlier entry for it).

        Only the newest :data:`CONTRIBUTOR_VERSIONS` versions are kept.
        """
        entries = {v: tuple(p) for v, p in self.contributors}
        entries[int(version)] = tuple(sorted(set(peers)))
        self.contributors = sorted(entries.items())[-CONTRIBUTOR_VERSIONS:]

    def contributed(self, version: int, peer: str) -> bool | None:
        """Whether ``peer``'s outer gradient went into ``version``; None when this state does not know."""
        for v, peers in self.contributors:
            if v == version:
                return peer in peers
        return None

    def remember(self) -> None:
        """Record the current state in its own history (after every change of Θ)."""
        entry = (self.version, self.sha256())
        if not self.history or self.history[-1] != entry:
            self.history.append(entry)
            del self.history[:-HISTORY_LENGTH]

    def descends_from(self, version: int, sha: str) -> bool:
        """Whether (``version``, ``sha``) is in this state's history: an ancestor, or this state once remembered."""
        return (version, sha) in {tuple(h) for h in self.history}

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> GlobalState:
        """Version 0 from a module's parameters: fp32 CPU copies, zero momentum, empty history."""
        params = [p.detach().to("cpu", torch.float32, copy=True) for p in module.parameters()]
        return cls(params=params, momentum=[torch.zeros_like(p) for p in params])

    def tensors(self) -> list[torch.Tensor]:
        """Parameters then momentum buffers: the order in which the state is hashed and served."""
        return [*self.params, *self.momentum]

    def sha256(self) -> str:
        """Hash of the tensors, version, momentum flag, tokens and standing (not the history or contributors)."""
        return state_sha256(self.tensors(), self.version, self.momentum_initialized, self.tokens, self.standing)

    def to_dict(self, tensors: bool = True) -> dict[str, Any]:
        """The one serialised form, for checkpoints (with tensors) and for the metadata served to peers
        (without: the tensors travel separately, see :mod:`p2p_diloco.core.state_layout`)."""
        out: dict[str, Any] = {
            "version": self.version, "momentum_initialized": self.momentum_initialized, "tokens": self.tokens,
            "history": [list(h) for h in self.history],
            "contributors": [[v, list(peers)] for v, peers in self.contributors],
            "certificates": list(self.certificates),
            "standing": dict(self.standing),
        }
        if tensors:
            out["params"], out["momentum"] = self.params, self.momentum
        return out

    @classmethod
    def from_dict(cls, data: Any) -> GlobalState:
        """Inverse of :meth:`to_dict` (with tensors). Input may be hostile: every field is checked and
        anything malformed raises :class:`StateFormatError` naming the field."""
        if not isinstance(data, dict):
            raise StateFormatError("state is not a map")
        version, init, tokens = data.get("version"), data.get("momentum_initialized"), data.get("tokens")
        if not (isinstance(version, int) and 0 <= version < MAX_VERSION):
            raise StateFormatError(f"bad version {version!r}")
        if not isinstance(init, bool):
            raise StateFormatError("bad momentum_initialized")
        if not (isinstance(tokens, int) and 0 <= tokens < MAX_TOKENS):
            raise StateFormatError(f"bad tokens {tokens!r}")
        history = data.get("history", [])
        if not (isinstance(history, list | tuple) and len(history) <= 2 * HISTORY_LENGTH and all(
            isinstance(h, list | tuple) and len(h) == 2 and isinstance(h[0], int) and isinstance(h[1], str)
            for h in history
        )):
            raise StateFormatError("malformed history")
        contributors = data.get("contributors", [])
        if not (isinstance(contributors, list | tuple) and len(contributors) <= 4 * CONTRIBUTOR_VERSIONS and all(
            isinstance(e, list | tuple) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], list | tuple)
            and all(isinstance(peer, str) for peer in e[1]) for e in contributors
        )):
            raise StateFormatError("malformed contributors")
        certificates = data.get("certificates", [])
        if not (isinstance(certificates, list | tuple) and len(certificates) <= 2 * CERTIFIED_VERSIONS
                and all(isinstance(c, dict) for c in certificates)):
            raise StateFormatError("malformed certificates")
        try:
            standing_ = standings.parsed(data.get("standing", {}))
        except ValueError as e:
            raise StateFormatError(str(e)) from None
        params, momentum = data.get("params"), data.get("momentum")
        if not (isinstance(params, list) and isinstance(momentum, list) and len(params) == len(momentum)
                and all(isinstance(t, torch.Tensor) for t in [*params, *momentum])):
            raise StateFormatError("params and momentum must be two lists of tensors of one length")
        return cls(params=params, momentum=momentum, version=version, momentum_initialized=init, tokens=tokens,
                   history=[(int(v), str(h)) for v, h in history],
                   contributors=[(int(v), tuple(map(str, peers))) for v, peers in contributors],
                   certificates=list(certificates), standing=standing_)

    def copy(self) -> GlobalState:
        """A deep copy: cloned tensors, new history and contributors lists."""
        return GlobalState(
            params=[p.clone() for p in self.params],
            momentum=[m.clone() for m in self.momentum],
            version=self.version,
            momentum_initialized=self.momentum_initialized,
            tokens=self.tokens,
            history=list(self.history),
            contributors=list(self.contributors),
            certificates=list(self.certificates),
            standing=dict(self.standing),
        )


def _cert_version(certificate: dict[str, Any]) -> int:
    commit = certificate.get("commit")
    version = commit.get("version") if isinstance(commit, dict) else None
    return version if isinstance(version, int) else -1


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a hash as :func:`state_sha256` writes it (64 lowercase hex digits): for input from peers."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def state_sha256(
    tensors: Sequence[torch.Tensor], version: int, momentum_initialized: bool, tokens: int = 0,
    standing: Mapping[str, int] | None = None,
) -> str:
    """SHA-256 (hex) of the version, momentum flag, tokens and standing (when not empty), then each tensor's
    shape and raw bytes, in order."""
    h = hashlib.sha256()
    h.update(f"v{version}m{int(momentum_initialized)}t{int(tokens)}".encode())
    if standing:
        h.update(b"s" + standings.to_bytes(standing))
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]) -> list:
    """Δ = Θ − θ in fp32 on CPU."""
    return [g - p.detach().to("cpu", torch.float32) for g, p in zip(global_params, local_params, strict=True)]


def weighted_mean(deltas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Reference Σ wᵢ Δᵢ / Σ wᵢ (used by tests and the in-process averaging fake)."""
    if not deltas:
        raise ValueError("no outer gradients to average")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    out = [torch.zeros_like(t, dtype=torch.float32) for t in deltas[0]]
    for delta, w in zip(deltas, weights, strict=True):
        for acc, t in zip(out, delta, strict=True):
            acc.add_(t.float(), alpha=float(w))
    return [acc.div_(total) for acc in out]


@dataclass
class OuterOptimizer:
    """SGD with (Nesterov) momentum applied in place to a :class:`GlobalState`."""

    cfg: OuterConfig
    _scratch: list[torch.Tensor] = field(default_factory=list, repr=False)

    @torch.no_grad()
    def apply(self, state: GlobalState, avg_delta: Sequence[torch.Tensor], tokens: int = 0,
              work: float = 1.0, span: float = 1.0) -> None:
        """One outer step on ``state``, in place (formulas in the module docstring): version + 1, ``tokens`` added,
        history recorded. ``avg_delta``: the averaged outer gradient, one tensor per parameter (ValueError otherwise).
        ``work``: the share of a full outer step the round carries (:func:`round_work`); below 1 it scales the
        momentum's part when ``outer.short_rounds`` is "scaled". ``span``: the outer steps' time the round spans
        (:func:`round_span`); above 1 the momentum going on is :func:`decayed_momentum` (μ**span at whole spans)
        when ``outer.long_rounds`` is "decayed".
        """
        if len(avg_delta) != len(state.params):
            raise ValueError(f"expected {len(state.params)} outer gradients, got {len(avg_delta)}")
        mu, lr = self.cfg.momentum, self.cfg.lr
        if self.cfg.long_rounds == "decayed" and math.isfinite(span) and span > 1.0:
            mu = decayed_momentum(mu, span)
        w = min(max(float(work), 0.0), 1.0) if self.cfg.short_rounds == "scaled" and math.isfinite(work) else 1.0
        decay, ahead = (mu, mu) if w == 1.0 else (1.0 - w * (1.0 - mu), w * mu)
        for p, b, d in zip(state.params, state.momentum, avg_delta, strict=True):
            if d.shape != p.shape:
                raise ValueError(f"outer gradient of shape {tuple(d.shape)} for parameter {tuple(p.shape)}")
            if self.cfg.momentum == 0:  # not the decayed μ: μ**span may underflow to 0 for a tiny μ
                p.sub_(d, alpha=lr)
                continue
            if state.momentum_initialized:
                b.mul_(decay).add_(d)
            else:
                b.copy_(d)
            if self.cfg.nesterov:
                p.sub_(d + ahead * b, alpha=lr)
            elif w == 1.0:
                p.sub_(b, alpha=lr)
            else:
                p.sub_(d + w * (b - d), alpha=lr)
        state.momentum_initialized = True
        state.version += 1
        state.tokens = min(state.tokens + max(int(tokens), 0), MAX_TOKENS - 1)  # saturates: always serializable
        state.remember()


def round_work(members: Iterable[tuple[float, int | None]], steps_per_outer: int) -> float:
    """The share of a full outer step that a round carries: the mean of its contributions' inner steps
    (each at most H = ``steps_per_outer``) over H, weighted as they were averaged; ``members``: (weight,
    steps) per contributor (steps None: not gathered, or not a count: a whole outer step's), in an order
    every member of the group shares (sorted by peer), the weights
    bounded by what the steps allow (:mod:`p2p_diloco.core.exclusion`: tokens ≤ steps·T), so that a peer
    claiming few steps weighs little. 1.0 when nothing says otherwise (no weight, no H). The same sums in
    the same order: every member of the group computes the same float."""
    pairs = [(max(float(w), 0.0), steps_per_outer if s is None else min(max(int(s), 0), steps_per_outer))
             for w, s in members]
    total = sum(w for w, _ in pairs)
    if not total > 0 or not math.isfinite(total) or steps_per_outer <= 0:
        return 1.0
    return min(1.0, sum(w * s for w, s in pairs) / (total * steps_per_outer))


MAX_SPAN = 64.0  # μ**64 is below 0.0012 at μ = 0.9: momentum a round this long passes on is nil


def round_span(steps: Iterable[int | None], steps_per_outer: int) -> float:
    """How many outer steps' time a round spans: the lower median of its contributions' inner steps (None:
    not a count, taken as H) over H = ``steps_per_outer``, at least 1 and at most :data:`MAX_SPAN`. The lower
    median, so that a peer claiming more steps than it took cannot stretch the span (in a pair it is the
    smaller count); every member of the group computes the same float from the same counts."""
    counts = sorted(steps_per_outer if s is None else max(int(s), 0) for s in steps)
    if not counts or steps_per_outer <= 0:
        return 1.0
    return min(MAX_SPAN, max(1.0, counts[(len(counts) - 1) // 2] / steps_per_outer))


def decayed_momentum(mu: float, span: float) -> float:
    """μ**span for span ≥ 0 without ``pow``: μ multiplied in once per whole outer step, then linear in the
    fraction left (1 − f·(1 − μ)), so every member gets the same bits; equal to μ**span at whole spans.

    >>> decayed_momentum(0.9, 1.0), decayed_momentum(0.9, 2.0), decayed_momentum(0.9, 2.5)
    (0.9, 0.81, 0.7695)
    """
    whole = int(span)
    out = 1.0
    for _ in range(whole):
        out *= mu
    return out * (1.0 - (span - whole) * (1.0 - mu))


def apply_result(
    local_params: Sequence[torch.Tensor], new_global: Sequence[torch.Tensor], base: Sequence[torch.Tensor],
    policy: ApplyPolicy,
) -> None:
    """Take a new Θ_f into the local parameters θ_f, in place; the one formula for every door a result
    comes in by (a round applied on time, a round applied late, a download).

    - ``overwrite``: θ ← Θ_new. Local progress made since ``base`` is dropped.
    - ``mix``: θ ← Θ_new + (θ − base). What was trained since ``base`` is kept on top of Θ_new. With
      ``base`` = the Θ the local progress started from, this is a rebase: the inner steps stay an
      outer gradient relative to the new global parameters and count in the next round.

    >>> local = [torch.tensor([1.0, 2.0])]  # θ, trained on from base = [0.5, 0.5]
    >>> apply_result(local, [torch.tensor([10.0, 10.0])], [torch.tensor([0.5, 0.5])], "mix")
    >>> local[0].tolist()
    [10.5, 11.5]
    >>> apply_result(local, [torch.tensor([3.0, 4.0])], [torch.tensor([0.0, 0.0])], "overwrite")
    >>> local[0].tolist()
    [3.0, 4.0]
    """
    with torch.no_grad():
        for p, new, old in zip(local_params, new_global, base, strict=True):
            if policy == "mix":
                p.copy_((new + (p.detach().to("cpu", torch.float32) - old)).to(p.dtype))
            else:
                p.copy_(new.to(p.dtype))


def rebase(local_params: Sequence[torch.Tensor], old_global: Sequence[torch.Tensor],
           new_global: Sequence[torch.Tensor]) -> None:
    """Move local progress onto a newer Θ: θ ← Θ_new + (θ − Θ_old), in place (``mix`` of :func:`apply_result`).

    Used when a learner finds the swarm ahead of it: the inner steps it took are kept as an outer
    gradient relative to the new global parameters and are contributed in its next round.
    """
    apply_result(local_params, new_global, old_global, "mix")


def load_into_module(module: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
    """Copy ``params`` into the module's parameters in order, cast to each parameter's device and dtype."""
    with torch.no_grad():
        for p, g in zip(module.parameters(), params, strict=True):
            p.copy_(g.to(p.device, p.dtype))


def merge_lineages(a: GlobalState, b: GlobalState) -> GlobalState:
    """Heal a split brain: one state from two that advanced the same fragment separately.

    Θ and the momentum are averaged weighted by each lineage's merged tokens, in fp64, with the two
    inputs ordered by hash, so every learner that merges the same two states gets the same bytes.
    The result's version is one past the newer input's, so both sides adopt it as a descendant.
    """
    first, second = sorted((a, b), key=lambda s: s.sha256())
    wa, wb = float(max(first.tokens, 1)), float(max(second.tokens, 1))
    total = wa + wb

    def mix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x.double() * wa + y.double() * wb) / total).float()

    merged = GlobalState(
        params=[mix(x, y) for x, y in zip(first.params, second.params, strict=True)],
        momentum=[mix(x, y) for x, y in zip(first.momentum, second.momentum, strict=True)],
        version=max(first.version, second.version) + 1,
        momentum_initialized=first.momentum_initialized or second.momentum_initialized,
        tokens=max(first.tokens, second.tokens),
        history=sorted({(v, h) for v, h in [*first.history, *second.history]}),
        standing=standings.merged(first.standing, second.standing),
    )
    for v, peers in [*first.contributors, *second.contributors]:
        # Both lineages may have a version v; a learner in either one's round contributed to the merge.
        merged.record_contributors(v, [*peers, *dict(merged.contributors).get(v, ())])
    merged.remember()
    return merged
