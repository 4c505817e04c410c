"""How contributions are weighted and combined (pure math, no networking).

Token weighting (Decoupled DiLoCo): w = tokens · (tokens / steps). A learner that processed more
tokens counts more, and among equal token counts the one that took fewer, larger steps counts more.

Staleness rule: a contribution that spans v fragment versions the learner did not take part in
(it was slow, absent, or its rounds failed, and it rebased its progress onto newer global
parameters) is down-weighted by 1 / (1 + v). It is never discarded and, because the learner's Δ is
reset only when a round that included it commits, never applied twice.

Radial-directional averaging (RDA): outer gradients of different learners are nearly orthogonal,
so their plain mean shrinks like 1/√M. RDA keeps the weighted mean of the norms and the direction
of the weighted mean of unit vectors:

    RDA(Δ₁..Δ_M) = (Σ wᵢ‖Δᵢ‖ / Σ wᵢ) · û,   û = normalize(Σ wᵢ Δᵢ/‖Δᵢ‖)

It runs inside the ordinary weighted all-reduce: each learner sends Δᵢ/‖Δᵢ‖ and gathers ‖Δᵢ‖ with
its group metadata, so no second round trip is needed; every member computes the same norm from
the same gathered numbers and the same averaged unit vector, so results stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_weight(tokens: int, steps: int, missed_versions: int = 0, rule: str = "tokens2_per_step") -> float:
    """Weight of one learner's contribution to one fragment's round (``rule``: ``sync.weighting``).

    >>> token_weight(tokens=1000, steps=10)  # tokens · tokens / steps
    100000.0
    >>> token_weight(1000, 10, missed_versions=1), token_weight(1000, 10, rule="tokens")
    (50000.0, 1000.0)
    """
    if tokens <= 0 or steps <= 0:
        return 0.0
    base = float(tokens) if rule == "tokens" else float(tokens) * (float(tokens) / float(steps))
    return base / (1.0 + max(0, int(missed_versions)))


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` taken together, summed in fp64."""
    return float(torch.sqrt(sum(((t.double() ** 2).sum() for t in tensors), torch.zeros((), dtype=torch.float64))))


def to_unit(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """(Δ/‖Δ‖, ‖Δ‖); a zero Δ stays zero."""
    norm = global_norm(tensors)
    if norm == 0.0:
        return [t.clone() for t in tensors], 0.0
    return [(t / norm).float() for t in tensors], norm


def rda_combine(avg_unit: Sequence[torch.Tensor], norms: Sequence[float], weights: Sequence[float]) -> list:
    """Mean norm times the direction of the averaged unit vectors (deterministic fp32/fp64 ops)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    mean_norm = sum(float(w) * float(n) for w, n in zip(weights, norms, strict=True)) / total
    direction_norm = global_norm(avg_unit)
    if direction_norm == 0.0:
        return [torch.zeros_like(t) for t in avg_unit]
    scale = mean_norm / direction_norm
    return [(t.double() * scale).float() for t in avg_unit]


def rda_reference(deltas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Plain implementation of RDA for tests: no all-reduce, no shortcuts."""
    units, norms = zip(*(to_unit(d) for d in deltas), strict=True)
    total = float(sum(weights))
    avg = [sum(float(w) * u[k].double() for w, u in zip(weights, units, strict=True)) / total
           for k in range(len(deltas[0]))]
    return rda_combine([a.float() for a in avg], norms, weights)
