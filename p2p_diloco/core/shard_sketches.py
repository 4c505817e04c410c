"""Checking the reducers: random projections of what each member sent and of what came back.

In the butterfly all-reduce each shard is averaged by one reducer, and every member overwrites its
copy with what that reducer returned (:mod:`p2p_diloco.net.allreduce`). A reducer that returns a chosen
shard to everyone would have it committed: every member computes the same state from it, so the
commit certificate holds. Only the senders of a shard know what went into it, each its own part.

The check (docs/security.md, "Reducers"): after the all-reduce, each member derives a seed from the
**result** (sha256 of the averaged fragment, bit-identical on every member) and draws from it
:data:`PROJECTIONS` Gaussian vectors g of the longest shard's length, one set for all shards (a shard's
coordinate i meets g_i in every shard). For each shard r it publishes, signed, the projections ⟨g, x_r⟩
of the part x_r it sent to r (as r decoded and clipped it) and keeps ⟨g, y_r⟩ of the shard y_r it
received. Projections are linear, so an honest reducer's shard meets

    ⟨g, y_r⟩ = Σ_i w_i ⟨g, x_i,r⟩ / Σ_i w_i     (w_i: the verdict's weights, as the reducer used them)

up to the codec's rounding of the reply and fp32 sums. The seed is fixed only once y is, so a reducer
cannot choose y to fit projections it does not know yet (changing y changes g), nor can several reducers
together (the seed is fixed once every shard is, so one set of vectors for all shards is as safe as one
per shard, and costs a group of N members N times less drawing); for a difference Δ
from the true average, ⟨g, Δ⟩ is a normal variable of standard deviation ‖Δ‖, and the rounding ε
of an honest reply gives ⟨g, ε⟩ of standard deviation ‖ε‖ ≤ ‖codec bound‖. The tolerance is
:data:`Z` standard deviations of that honest error (a false alarm about once in 10¹⁵ checks), so a
reducer is caught when it moves its shard by much more than the codec's own rounding: with four
projections a change of 10 tolerances passes unseen with probability about 4·10⁻⁵.

A member that finds a shard that does not match signs nothing (the round fails for it) and bans that
shard's reducer from its next rounds, like an excluded contributor (:class:`p2p_diloco.core.bans.Bans`):
when a majority of a group holds the ban, the reducer is left out, and the others commit without it.

Robust aggregators (median, trimmed mean) are not linear, so projections do not apply. Two checks
hold for every aggregator and are made for all of them:

- **Spot checks.** From (seed, r) each member draws :data:`SPOTS` coordinates of shard r; senders
  publish their part's values there, receivers the shard's. Anyone recomputes the aggregate at those
  coordinates (:func:`p2p_diloco.core.aggregators.aggregate`, the same code the reducer runs) and compares,
  within the codec's elementwise bound plus an fp32 allowance. A reducer that changes a fraction f of
  its shard is caught with probability 1 − (1 − f)^SPOTS (f = 10 %: 97 %; f = 1 %: 28 %).
- **A norm bound.** Mean, median and trimmed mean put each coordinate between the smallest and largest
  input there, so ‖y_r‖ ≤ √(Σ_i ‖x_i,r‖²) (plus the reply's rounding): a lie on a few coordinates
  that the spots miss still cannot be larger than all the honest inputs together.

Under the mean the projections catch any change; under a robust aggregator a reducer can still move
a few coordinates within the norm bound unseen.

What it does not cover: a sender whose sketch lies: nobody can tell it from a lying reducer, so the
round fails and that shard's (honest) reducer is banned for a few rounds: a malicious member can
spend its rounds to have honest reducers left out, though not to change what is committed.

Sketches are plain msgpack-able dicts: ``{"seed": hex, "vectors": VECTORS, "aggregator": name,
"shards": [[reducer peer id, start, end], ...], "sent": [[k floats] per shard], "result": [[k floats]
per shard], "bound": [float per shard], "sent_spots": [[s floats] per shard], "sent_norm": [float per
shard], "result_spots": [[s floats] per shard], "spot_bound": [[s floats] per shard], "result_norm":
[float per shard]}``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from p2p_diloco.core.aggregators import AGGREGATORS, aggregate

PROJECTIONS = 4
CHUNK = 1 << 20  # coordinates of the projection vectors drawn at a time (32 MiB of fp64 for four vectors)
# How the vectors are drawn, carried in every sketch: a groupmate that draws them another way (an older
# version) has its sketch named as such, instead of its projections failing to match and a reducer being blamed.
VECTORS = "one set per sketch, drawn by the megavalue"
SPOTS = 32
Z = 8.0
_FP32_SUM = 2.0**-20  # relative error allowance of a reducer's fp32 weighted sum, per sender


def sketch_key(prefix: str, seed: str) -> str:
    """The DHT key the members of one all-reduce publish their sketches under (subkey: each one's owner marker)."""
    return f"{prefix}_sketch_{seed[:32]}"


def seed_of(outputs: Sequence[torch.Tensor]) -> str:
    """sha256 of the averaged fragment's fp32 bytes (the same on every member of the group)."""
    h = hashlib.sha256()
    for t in outputs:
        h.update(t.detach().to(torch.float32).contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def _vectors(seed: str, chunk: int, n: int) -> torch.Tensor:
    """The :data:`PROJECTIONS` Gaussian vectors' values at coordinates [chunk·CHUNK, chunk·CHUNK + n) of every
    shard, as a (PROJECTIONS, n) fp64 tensor drawn from (seed, chunk)."""
    digest = hashlib.sha256(f"{seed}:{chunk}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(PROJECTIONS, n, generator=gen, dtype=torch.float32).double()


def projections(seed: str, shards: Sequence[Sequence[torch.Tensor]]) -> list[list[list[float]]]:
    """Per shard, per vector of ``shards[r]`` (1-D, the shard's length): its :data:`PROJECTIONS` projections.

    Every shard is projected on the same Gaussian vectors (coordinate i of a shard meets the same values
    in every shard), drawn :data:`CHUNK` coordinates at a time from (seed, chunk) up to the longest shard's
    length; every member knows the layout, so every member draws the same vectors. Each shard's check
    stays a projection on Gaussian vectors that nobody knew before the result was fixed; drawing them
    once instead of once per shard divides the cost of drawing by the number of shards.
    """
    longest = max((v.numel() for vectors in shards for v in vectors), default=0)
    out = [[torch.zeros(PROJECTIONS, dtype=torch.float64) for _ in vectors] for vectors in shards]
    for chunk, lo in enumerate(range(0, longest, CHUNK)):
        g = _vectors(seed, chunk, min(CHUNK, longest - lo))
        for vectors, acc in zip(shards, out, strict=True):
            for v, a in zip(vectors, acc, strict=True):
                part = v.reshape(-1)[lo:lo + CHUNK]
                if part.numel():
                    a += g[:, :part.numel()] @ part.double()
    return [[a.tolist() for a in acc] for acc in out]


def spots(seed: str, shard: int, n: int) -> torch.Tensor:
    """The coordinates of a shard of ``n`` values that the spot check compares (drawn from the seed)."""
    digest = hashlib.sha256(f"{seed}:{shard}:spots".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randint(n, (min(SPOTS, n),), generator=gen)


def sketch(seed: str, shards: Sequence[tuple[str, int, int]], sent: Sequence[torch.Tensor],
           result: torch.Tensor, bound: Any, aggregator: str = "mean") -> dict[str, Any]:
    """This member's sketch of one all-reduce.

    ``shards``: (reducer, start, end) ranges of the flat fragment; ``sent``: per shard, the part we sent
    as the reducer decoded and clipped it; ``result``: the flat averaged fragment; ``bound(y)``: the
    codec's elementwise bound on rounding ``y`` (:meth:`Quantizer.error_bound`); ``aggregator``: what the
    reducers computed (:mod:`p2p_diloco.core.aggregators`).
    """
    out: dict[str, Any] = {"seed": seed, "vectors": VECTORS, "aggregator": aggregator,
                           "shards": [[p, a, b] for p, a, b in shards],
                           "sent": [], "result": [], "bound": [], "sent_spots": [], "sent_norm": [],
                           "result_spots": [], "spot_bound": [], "result_norm": []}
    pairs = [(result[a:b].reshape(-1), part.reshape(-1).to(torch.float32))
             for (_, a, b), part in zip(shards, sent, strict=True)]
    for r, ((y, x), (got_y, got_x)) in enumerate(zip(pairs, projections(seed, pairs), strict=True)):
        err = bound(y).double().reshape(-1)
        at = spots(seed, r, y.numel())
        out["result"].append(got_y)
        out["sent"].append(got_x)
        out["bound"].append(float(err.norm()))
        out["sent_spots"].append([float(v) for v in x[at]])
        out["sent_norm"].append(float(x.double().norm()))
        out["result_spots"].append([float(v) for v in y[at]])
        out["spot_bound"].append([float(v) for v in err[at]])
        out["result_norm"].append(float(y.double().norm()))
    return out


def _floats(value: Any, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in value))


def malformed(s: Any, like: Mapping[str, Any]) -> str:
    """Why sketch ``s`` (from a peer) cannot be checked against ours, ``like``; "" if it can."""
    if not isinstance(s, dict):
        return "not a sketch"
    if s.get("vectors") != like.get("vectors"):
        return "made by another version of the reducer check (its projection vectors are drawn otherwise)"
    if s.get("seed") != like["seed"]:
        return "computed from another result (the reducers sent it different shards)"
    if s.get("shards") != like["shards"] or s.get("aggregator") != like["aggregator"]:
        return "made for another layout of shards or another aggregator"
    n = len(like["shards"])
    sent, at, norms = s.get("sent"), s.get("sent_spots"), s.get("sent_norm")
    if not isinstance(sent, list) or len(sent) != n or not all(_floats(x, PROJECTIONS) for x in sent):
        return "malformed projections"
    if not isinstance(at, list) or len(at) != n \
            or not all(_floats(x, len(ours)) for x, ours in zip(at, like["result_spots"], strict=True)):
        return "malformed spot values"
    if not isinstance(norms, list) or not _floats(norms, n) or any(x < 0 for x in norms):
        return "malformed norms"
    return ""


def check(mine: Mapping[str, Any], sketches: Mapping[str, Any], weights: Mapping[str, float],
          norms: Mapping[str, float]) -> str:
    """"" if every shard we received is the weighted mean of what its senders sketched; else why not.

    ``sketches``: every sender's sketch (ours included), by peer id; ``weights``: the weights the
    reducers used; ``norms``: a bound on the norm of each sender's whole clipped part (for the fp32
    allowance).
    """
    return first_mismatch(mine, sketches, weights, norms)[0]


def _oversized(peer: str, s: Mapping[str, Any], shards: int, bound: float) -> str:
    """Why the parts ``peer`` sketched are larger than its declared norm allows ("" if they are not).

    Reducers refuse another sender's part above its declared norm (net/allreduce.py), but nobody checks the
    part a reducer adds to its own shard: it could set that shard under the mean with any part it sketches
    truthfully. Each sketch's ``sent_norm`` must fit ``bound`` (the sender's declared norm, clipped, with the
    same 10% the caller allows), and its projections must fit the norm it gives them: a projection on a
    standard Gaussian vector is N(0, ‖x‖²), beyond Z·‖x‖ once in about 10¹⁵.
    """
    for r in range(shards):
        norm = s["sent_norm"][r]
        if not norm <= 1.1 * bound + 1e-9:
            return (f"{peer[-6:]} sketched a part of norm {norm:.6g} for shard {r}, above the {bound / 1.1:.6g} "
                    f"its declared norm allows: its part is too large, or its sketch lied")
        if any(not abs(x) <= Z * norm * (1 + 1e-6) + 1e-12 for x in s["sent"][r]):
            return (f"the sketch of {peer[-6:]} is inconsistent: a projection of its part for shard {r} is more "
                    f"than {Z:g} times the part's norm ({norm:.6g})")
    return ""


def first_mismatch(mine: Mapping[str, Any], sketches: Mapping[str, Any], weights: Mapping[str, float],
                   norms: Mapping[str, float]) -> tuple[str, str | None]:
    """:func:`check`'s answer, and who is to blame: the reducer of the first shard that did not match, or a sender
    whose sketched parts exceed its declared norm (None: no shard was checked against wrong numbers, e.g. a
    sketch is missing)."""
    for peer in sorted(weights):
        if peer not in sketches:
            return f"no sketch from {peer[-6:]}", None
        why = malformed(sketches[peer], mine)
        if why:
            return f"the sketch of {peer[-6:]} is {why}", None
    total = sum(weights.values())
    if not total > 0:
        return "the senders' weights sum to zero", None
    kind = mine["aggregator"]
    if kind not in AGGREGATORS:
        return f"unknown aggregator {kind!r}", None
    senders = sorted(weights)
    for peer in senders:
        why = _oversized(peer, sketches[peer], len(mine["shards"]), norms.get(peer, math.inf))
        if why:
            return why, peer
    fp32 = _FP32_SUM * len(weights) * sum(weights[p] / total * norms.get(p, 0.0) for p in weights)
    for r, (reducer, _, _) in enumerate(mine["shards"]):
        lied = (f"the shard reduced by {str(reducer)[-6:]} does not match what its senders sent ({{}}): "
                f"that reducer, or a sender's sketch, lied")
        if kind == "mean":  # projections: exact for a linear aggregate
            tol = Z * (1.01 * mine["bound"][r] + fp32) + 1e-12
            for j in range(PROJECTIONS):
                want = sum(weights[p] * sketches[p]["sent"][r][j] for p in weights) / total
                got = mine["result"][r][j]
                if not abs(got - want) <= tol:
                    return lied.format(f"projection {j}: {got:.6g} against {want:.6g}, allowed ±{tol:.3g}"), \
                        str(reducer)
        inputs = torch.tensor([sketches[p]["sent_spots"][r] for p in senders], dtype=torch.float64)
        want_at = aggregate(list(inputs), [weights[p] for p in senders], kind)
        slack = _FP32_SUM * len(senders) * inputs.abs().amax(dim=0) + 1e-12
        for i, (got, want) in enumerate(zip(mine["result_spots"][r], want_at.tolist(), strict=True)):
            if not abs(got - want) <= 1.01 * mine["spot_bound"][r][i] + float(slack[i]):
                return lied.format(f"spot {i}: {got:.6g} against {want:.6g}"), str(reducer)
        limit = math.sqrt(sum(sketches[p]["sent_norm"][r] ** 2 for p in senders)) * (1 + 1e-5) \
            + 1.01 * mine["bound"][r] + 1e-12
        if not mine["result_norm"][r] <= limit:
            return lied.format(f"norm {mine['result_norm'][r]:.6g} above its senders' {limit:.6g}"), str(reducer)
    return "", None
