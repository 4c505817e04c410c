"""Checking the reducers: random projections of what each member sent and of what came back.

In the butterfly all-reduce each shard is averaged by one reducer, and every member overwrites its
copy with what that reducer returned (:mod:`p2p_diloco.allreduce`). A reducer that returns a chosen
shard to everyone would have it committed: every member computes the same state from it, so the
commit certificate holds. Only the senders of a shard know what went into it, each its own part.

The check (docs/security.md, "Reducers"): after the all-reduce, each member derives a seed from the
**result** (sha256 of the averaged fragment, bit-identical on every member), and for each shard r and
j < :data:`PROJECTIONS` draws a Gaussian vector g from (seed, r, j). It publishes, signed, the
projections ⟨g, x_r⟩ of the part x_r it sent to r (as r decoded and clipped it) and keeps
⟨g, y_r⟩ of the shard y_r it received. Projections are linear, so an honest reducer's shard meets

    ⟨g, y_r⟩ = Σ_i w_i ⟨g, x_i,r⟩ / Σ_i w_i     (w_i: the verdict's weights, as the reducer used them)

up to the codec's rounding of the reply and fp32 sums. The seed is fixed only once y is, so a reducer
cannot choose y to fit projections it does not know yet (changing y changes g); for a difference Δ
from the true average, ⟨g, Δ⟩ is a normal variable of standard deviation ‖Δ‖, and the rounding ε
of an honest reply gives ⟨g, ε⟩ of standard deviation ‖ε‖ ≤ ‖codec bound‖. The tolerance is
:data:`Z` standard deviations of that honest error (a false alarm about once in 10¹⁵ checks), so a
reducer is caught when it moves its shard by much more than the codec's own rounding: with four
projections a change of 10 tolerances passes unseen with probability about 4·10⁻⁵.

A member that finds a shard that does not match signs nothing (the round fails for it) and bans that
shard's reducer from its next rounds, like an excluded contributor (:class:`p2p_diloco.exclusion.Bans`):
when a majority of a group holds the ban, the reducer is left out, and the others commit without it.

What it does not cover: robust aggregators (a median is not linear; no sketch is made), and a sender
whose sketch lies: nobody can tell it from a lying reducer, so the round fails and that shard's
(honest) reducer is banned for a few rounds: a malicious member can spend its rounds to have honest
reducers left out, though not to change what is committed.

Sketches are plain msgpack-able dicts: ``{"seed": hex, "shards": [[reducer peer id, start, end], ...],
"sent": [[k floats] | None per shard], "result": [[k floats] per shard], "bound": [float per shard]}``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

PROJECTIONS = 4
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


def projections(seed: str, shard: int, *vectors: torch.Tensor) -> list[list[float]]:
    """For each of ``vectors`` (1-D, the same length): its :data:`PROJECTIONS` projections on shard's vectors."""
    n = vectors[0].numel()
    out: list[list[float]] = [[] for _ in vectors]
    as64 = [v.reshape(-1).double() for v in vectors]
    for j in range(PROJECTIONS):
        digest = hashlib.sha256(f"{seed}:{shard}:{j}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        g = torch.randn(n, generator=gen, dtype=torch.float32).double()
        for k, v in enumerate(as64):
            out[k].append(float(g @ v))
    return out


def sketch(seed: str, shards: Sequence[tuple[str, int, int]], sent: Sequence[torch.Tensor | None],
           result: torch.Tensor, bound: Any) -> dict[str, Any]:
    """This member's sketch of one all-reduce.

    ``shards``: (reducer, start, end) ranges of the flat fragment; ``sent``: per shard, the part we sent
    as the reducer decoded and clipped it (None if we sent none); ``result``: the flat averaged fragment;
    ``bound(y)``: the codec's elementwise bound on rounding ``y`` (:meth:`Quantizer.error_bound`).
    """
    out: dict[str, Any] = {"seed": seed, "shards": [[p, a, b] for p, a, b in shards], "sent": [], "result": [],
                           "bound": []}
    for r, ((_, a, b), part) in enumerate(zip(shards, sent, strict=True)):
        y = result[a:b]
        got = projections(seed, r, y, *([] if part is None else [part]))
        out["result"].append(got[0])
        out["sent"].append(got[1] if part is not None else None)
        out["bound"].append(float(bound(y).double().norm()))
    return out


def _floats(value: Any, n: int) -> bool:
    return (isinstance(value, list) and len(value) == n
            and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in value))


def malformed(s: Any, like: Mapping[str, Any]) -> str:
    """Why sketch ``s`` (from a peer) cannot be checked against ours, ``like``; "" if it can."""
    if not isinstance(s, dict):
        return "not a sketch"
    if s.get("seed") != like["seed"]:
        return "computed from another result (the reducers sent it different shards)"
    if s.get("shards") != like["shards"]:
        return "made for another layout of shards"
    sent = s.get("sent")
    if not isinstance(sent, list) or len(sent) != len(like["shards"]) \
            or not all(_floats(x, PROJECTIONS) for x in sent):
        return "malformed projections"
    return ""


def check(mine: Mapping[str, Any], sketches: Mapping[str, Any], weights: Mapping[str, float],
          norms: Mapping[str, float]) -> str:
    """"" if every shard we received is the weighted mean of what its senders sketched; else why not.

    ``sketches``: every sender's sketch (ours included), by peer id; ``weights``: the weights the
    reducers used; ``norms``: a bound on the norm of each sender's whole clipped part (for the fp32
    allowance).
    """
    return first_mismatch(mine, sketches, weights, norms)[0]


def first_mismatch(mine: Mapping[str, Any], sketches: Mapping[str, Any], weights: Mapping[str, float],
                   norms: Mapping[str, float]) -> tuple[str, str | None]:
    """:func:`check`'s answer, and the reducer of the first shard that did not match (None: no shard was
    checked against wrong numbers, e.g. a sketch is missing)."""
    for peer in sorted(weights):
        if peer not in sketches:
            return f"no sketch from {peer[-6:]}", None
        why = malformed(sketches[peer], mine)
        if why:
            return f"the sketch of {peer[-6:]} is {why}", None
    total = sum(weights.values())
    if not total > 0:
        return "the senders' weights sum to zero", None
    fp32 = _FP32_SUM * len(weights) * sum(weights[p] / total * norms.get(p, 0.0) for p in weights)
    for r, (reducer, _, _) in enumerate(mine["shards"]):
        tol = Z * (1.01 * mine["bound"][r] + fp32) + 1e-12
        for j in range(PROJECTIONS):
            want = sum(weights[p] * sketches[p]["sent"][r][j] for p in weights) / total
            got = mine["result"][r][j]
            if not abs(got - want) <= tol:
                return (f"the shard reduced by {str(reducer)[-6:]} does not match what its senders sent "
                        f"(projection {j}: {got:.6g} against {want:.6g}, allowed ±{tol:.3g}): that reducer, "
                        f"or a sender's sketch, lied"), str(reducer)
    return "", None
